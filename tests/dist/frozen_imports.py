"""Imported last by run_distributed's fork server (tests/dist/launch.py PRELOAD): what the server imported before it
goes to the collector's permanent generation, so that no collection in a rank forked from it walks those objects again.

A rank ends with os._exit (multiprocessing's), so no last collection at interpreter exit misses them.
"""

import gc

gc.collect()
gc.freeze()
