"""`python -m backend.parallel.node`: the documented command that starts this host's
tensor-parallel ranks. The launcher itself is backend.engine.tp.node (process orchestration sits
above the model and engine); this module only forwards to it when run as a script, and imports
nothing when imported, so backend/parallel/ stays below model/ and engine/
(tests/test_import_layering.py allows exactly this one upward import)."""

if __name__ == "__main__":
    import sys

    from backend.engine.tp.node import main

    sys.exit(main())
