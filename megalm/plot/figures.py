"""What every chart shares: matplotlib imported on demand (an optional extra, `PlotError` naming the install when it is
missing), figures on the Agg canvas (no display, no pyplot state), and PNGs written atomically that replace only
a chart megalm drew (its `Software` text chunk says so), so nothing of the user's is overwritten."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import TYPE_CHECKING

from megalm.errors import MegalmError

if TYPE_CHECKING:  # only for annotations: importing this module must not need matplotlib
    from matplotlib.figure import Figure

INSTALL_HINT = "plotting needs matplotlib; pip install 'megalm[plots]'"
WRITER = "megalm-plot"  # the PNG text chunk `Software` of every chart written here starts with it
DPI = 110


class PlotError(MegalmError):
    """A chart cannot be drawn: matplotlib missing, or its input (a run dir, metrics.jsonl) is unusable."""


def require_matplotlib() -> None:
    """Raise PlotError (one line, with the install command) if matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
        import matplotlib.figure  # noqa: F401
    except ImportError as e:
        raise PlotError(INSTALL_HINT) from e


def new_figure(width: float, height: float) -> Figure:
    """A Figure on the Agg canvas (no display), sized in inches."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def written_here(path: str | Path) -> bool:
    """Whether `path` is a PNG that megalm's plots wrote (their `Software` text chunk says so): the one kind of
    file a new chart may replace, as a re-run refreshes its own charts."""
    from PIL import Image, UnidentifiedImageError  # matplotlib's own dependency

    try:
        with Image.open(path) as image:
            return image.format == "PNG" and str(image.info.get("Software", "")).startswith(WRITER)
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError):  # not ours either way
        return False


def check_replaceable(*paths: str | Path) -> None:
    """PlotError (one line) if any of `paths` exists and is not a chart megalm wrote: nothing of the user's is
    overwritten. Callers check every chart they will write before writing the first."""
    for path in map(Path, paths):
        if path.suffix.lower() != ".png":  # savefig writes PNG bytes whatever the name says
            raise PlotError(f"{path}: megalm draws PNG charts; name the file *.png")
        if path.is_dir() or (path.exists() and not written_here(path)):
            raise PlotError(f"{path} exists and is not a chart megalm drew; nothing was written: move it or "
                            "pick another output path")


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write `fig` as a PNG (parent directories created), atomically (a temporary file renamed over the path), and
    marked as megalm's in its `Software` text chunk; refuses (`check_replaceable`) to replace another file.
    Returns the path."""
    import matplotlib

    path = Path(path)
    check_replaceable(path)
    ours = path.exists()  # a chart megalm drew (checked): replaced; else the path is taken only if still free
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        fig.savefig(partial, dpi=DPI, format="png",
                    metadata={"Software": f"{WRITER} (matplotlib {matplotlib.__version__})"})
        if ours:
            os.replace(partial, path)
        else:
            try:
                _place_new(partial, path)  # fails if a file appeared there since the check
            except FileExistsError:
                raise PlotError(f"{path} appeared while the chart was drawn; nothing was written: move it or "
                                "pick another output path") from None
    finally:
        partial.unlink(missing_ok=True)
    return path


def _place_new(partial: Path, path: Path) -> None:
    """Put `partial` at `path` only if nothing is there: a hard link (atomic, refused if the name exists). File
    systems without hard links (vfat, exFAT, SMB, FUSE object stores) refuse the link itself: there the name is
    claimed with O_EXCL, then the chart renamed over the empty file it made (no chart was written there before)."""
    try:
        os.link(partial, path)
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
            raise
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # FileExistsError if taken meanwhile
        os.replace(partial, path)
