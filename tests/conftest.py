"""Hermetic tests: no profile cached by `autopar profile` on this machine may change a plan."""
import os
import tempfile

os.environ["AUTOPAR_PROFILE_DIR"] = tempfile.mkdtemp(prefix="autopar-test-profiles-")
