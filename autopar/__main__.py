"""``python -m autopar``: the same command line as the ``autopar`` console script."""
import sys

from autopar.cli import main

# The guard matters: the demo's gloo ranks start from a forkserver that imports the main
# module (as ``__mp_main__``); it must not run the CLI again.
if __name__ == "__main__":
    sys.exit(main())
