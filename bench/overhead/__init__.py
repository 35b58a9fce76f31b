"""The measurements of bench/python_overhead.py (which imports them with bench/ on sys.path):
``common`` (shapes and layers), ``host`` (host time per call), ``model`` (a stack of layers and a
compiled model against the same eager)."""
