"""Imported last by run_distributed's fork server (tests/dist/launch.py PRELOAD): what the server imported before it
goes to the collector's permanent generation, so that no collection in a rank forked from it walks those objects again.

Unfrozen when the server exits (its parent gone): frozen, its interpreter's last collection skipped them, and Triton's
bindings (nanobind) printed hundreds of "leaked" lines into the test run's output. The ranks inherit the handler but
end with os._exit (multiprocessing's), which runs none.
"""

import atexit
import gc

atexit.register(gc.unfreeze)
gc.collect()
gc.freeze()
