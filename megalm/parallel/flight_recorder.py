"""torch's flight recorder for hang reports: each rank's last collectives, dumped when its watchdog fires, compared.

A hang is a rank that never enters a collective its peers wait in (or enters another one: a desync). torch keeps, per
process, a ring of its last collectives (and, under NCCL, point-to-point ops) with their number in their group (the
"flight recorder", `TORCH_FR_BUFFER_SIZE` entries; TorchTitan's `comm.trace_buf_size`), for NCCL and for gloo (torch
2.11 and 2.13 both record gloo's). megalm turns it on before the process group is made
(`parallel.flight_recorder_entries`, 20,000 as TorchTitan), and the hang watchdog (megalm/training/watchdog.py)
writes it as JSON, with megalm's names of the groups, to RUN_DIR/hang-rankR.flight.json before the rank exits.
`python -m megalm.parallel.flight_recorder RUN_DIR` then reads every rank's file and says, group by group, which
ranks stopped short of the collective the others wait in, and which ranks called different collectives under one
sequence number.

Hand-written: torch's analyser (`torch.distributed.flight_recorder`, `fr_trace`) reads NCCL's pickled dumps of the
whole world and fails on gloo's, which is what CPU runs and tests make; this compares the JSON dumps (no pickle) of
the ranks that wrote one, by group and sequence number only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megalm.data.files import write_atomically

FILE_GLOB = "hang-rank*.flight.json"


def record_collectives(entries: int) -> None:
    """Turn the flight recorder on for the process groups made after this (`entries` per process; 0 leaves it as the
    environment has it). A value the user exported under torch's name or its older one is kept (torch reads the new
    name first, and warns on every rank that the old one is deprecated: only the new one is set)."""
    if entries > 0 and not any(name in os.environ for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")):
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(entries)


def group_names(groups: dict[str, dist.ProcessGroup | None]) -> dict[str, dict[str, Any]] | None:
    """{torch's name of each group: megalm's role for it and its global ranks}, for the dump. `groups`: a mesh's,
    by role (`ParallelMesh.groups()`). None for a mesh of one process (no groups)."""
    if not any(group is not None for group in groups.values()):
        return None
    named: dict[str, dict[str, Any]] = {"0": {"role": "world", "ranks": list(range(dist.get_world_size()))}}
    for role, group in groups.items():
        if group is not None:
            entry = named.setdefault(group.group_name, {"role": role, "ranks": dist.get_process_group_ranks(group)})
            if role not in entry["role"].split("="):
                entry["role"] = f"{entry['role']}={role}"  # one group, two roles (dp and dp_cp when cp is 1)
    return named


def _torch_dumps() -> list[dict[str, Any]]:
    """This process's flight recorder, as torch writes it (JSON): gloo's, and NCCL's where it runs."""
    from torch._C import _distributed_c10d as c10d

    dumps = []
    for name in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):
        dump = getattr(c10d, name, None)
        if dump is None or (name == "_dump_nccl_trace_json" and not torch.cuda.is_available()):
            continue
        try:
            dumps.append(json.loads(dump(True, False)))
        except (RuntimeError, ValueError):  # not built with this backend, or nothing recorded
            continue
    return dumps


def dump(path: Path, rank: int, groups: dict[str, dict[str, Any]]) -> Path | None:
    """Write this rank's flight recorder to `path` (JSON): its entries, torch's per-group counters and `groups`
    (`group_names`). None when torch recorded nothing (the recorder off, or no collective yet)."""
    dumps = _torch_dumps()
    entries = [entry for d in dumps for entry in d.get("entries", [])]
    if not entries:
        return None
    status = {key: value for d in dumps for key, value in d.get("pg_status", {}).items()}
    record = json.dumps({"rank": rank, "groups": groups, "pg_status": status, "entries": entries}).encode()
    # whole or not at all: torchrun ends the other ranks when the first one exits, perhaps while they write theirs
    write_atomically(path, lambda f: f.write(record))
    return path


def _op(entry: dict[str, Any]) -> str:
    name = str(entry.get("profiling_name", "?")).split(":")[-1]
    return f"{name} {entry.get('input_sizes', [])}"


def _describe(group: str, groups: dict[str, dict[str, Any]]) -> str:
    known = groups.get(group)
    return f"group {group}" if known is None else f"the {known['role']} group {group} (ranks {known['ranks']})"


def compare(dumps: dict[int, dict[str, Any]]) -> list[str]:
    """What the ranks' dumps say, one line each: per process group, the ranks that stopped short of the collective
    others wait in, and collectives called differently under one sequence number. The first line names the ranks to
    look at (or says that none stands out)."""
    groups: dict[str, dict[str, Any]] = {}
    for d in dumps.values():
        groups.update(d.get("groups", {}))
    # group -> rank -> sequence number -> entry (collectives only: p2p ops count apart, below)
    seen: dict[str, dict[int, dict[int, dict[str, Any]]]] = {}
    waiting_p2p: list[str] = []
    for rank, d in sorted(dumps.items()):
        last_p2p = None
        for entry in d.get("entries", []):
            group = str(entry.get("process_group", ["?"])[0])
            if entry.get("is_p2p"):
                last_p2p = (group, entry)
                continue
            seen.setdefault(group, {}).setdefault(rank, {})[int(entry["collective_seq_id"])] = entry
        if last_p2p is not None and not last_p2p[1].get("retired", True):
            group, entry = last_p2p
            waiting_p2p.append(f"rank {rank} waits in {_op(entry)} (point-to-point #{entry.get('p2p_seq_id')} of "
                               f"{_describe(group, groups)})")
    lines, suspects = [], set()
    for group, by_rank in sorted(seen.items()):
        members = groups.get(group, {}).get("ranks") or sorted(by_rank)
        present = [r for r in members if r in dumps]
        pg_id = next(str(e.get("pg_id")) for entries in by_rank.values() for e in entries.values())
        last = {r: _last_enqueued(dumps[r], pg_id, by_rank.get(r, {})) for r in present}
        top = max(last.values(), default=0)
        where = _describe(group, groups)
        if missing := [r for r in members if r not in dumps]:
            lines.append(f"{where}: no flight recorder file from ranks {missing} (they exited before their "
                         "watchdog fired, or ran without the recorder)")
        if top == 0:
            continue
        desync = _desync(by_rank, present)
        if desync:  # (a desync's collectives never complete: that is the finding, not a stuck network)
            suspects.update(present)
            lines.append(f"{where}: {desync}: the ranks call different collectives (a desync)")
            continue
        ahead = [r for r in present if last[r] == top]
        entries = [by_rank[r][top] for r in ahead if top in by_rank.get(r, {})]
        if not entries or all(e.get("retired", True) for e in entries):
            continue  # the group's last collective completed: every rank entered it (older ones were dropped)
        behind = [r for r in present if last[r] < top]
        if behind:
            suspects.update(behind)
            stops = ", ".join(f"rank {r} at #{last[r]}" + (f" ({_op(by_rank[r][last[r]])})"
                                                            if last[r] in by_rank.get(r, {}) else "")
                              for r in behind)
            lines.append(f"{where}: ranks {ahead} entered #{top}, {_op(entries[0])}, and wait in it; {stops} never "
                         "entered it")
        else:
            lines.append(f"{where}: every rank entered #{top}, {_op(entries[0])}, and it did not complete (the "
                         "collective itself hangs: the network or the communication library)")
    lines.extend(waiting_p2p)
    head = (f"flight recorder: look at rank(s) {sorted(suspects)}" if suspects else
            "flight recorder: no rank stopped short of a collective its group waits in")
    return [f"{head} ({len(dumps)} rank(s) dumped)", *lines]


def _last_enqueued(dump: dict[str, Any], pg_id: str, entries: dict[int, dict[str, Any]]) -> int:
    """A rank's last collective in a group: its newest entry, or torch's counter of the group (`pg_status`), which
    counts on when the ring of entries has dropped them."""
    counted = dump.get("pg_status", {}).get(pg_id, {}).get("last_enqueued_collective")
    return max(max(entries, default=0), int(counted) if str(counted).lstrip("-").isdigit() else 0)


def _desync(by_rank: dict[int, dict[int, dict[str, Any]]], present: list[int]) -> str | None:
    """The first sequence number the ranks called differently (op or sizes), said; None if none."""
    for seq in sorted(set.intersection(*(set(by_rank.get(r, {})) for r in present))):
        calls = {r: _op(by_rank[r][seq]) for r in present}
        if len(set(calls.values())) > 1:
            return f"#{seq} differs between ranks ({'; '.join(f'rank {r}: {c}' for r, c in calls.items())})"
    return None


def read_dumps(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Every rank's dump in `run_dir` (the watchdog's files)."""
    dumps = {}
    for path in sorted(Path(run_dir).glob(FILE_GLOB)):
        d = json.loads(path.read_text())
        dumps[int(d["rank"])] = d
    return dumps


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megalm.parallel.flight_recorder",
                                     description="compare the ranks' flight recorder dumps of a hang (RUN_DIR/"
                                                 "hang-rank*.flight.json, written by the hang watchdog)")
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        dumps = read_dumps(args.run_dir)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: cannot read the flight recorder files in {args.run_dir}: {e}", file=sys.stderr)
        return 2
    if not dumps:
        print(f"error: no {FILE_GLOB} in {args.run_dir}: the run did not hang, or ran with "
              "parallel.flight_recorder_entries=0", file=sys.stderr)
        return 2
    for line in compare(dumps):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
