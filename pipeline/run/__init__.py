"""The run directory as the processes' shared API: `RunDir` names every path in it, holds the token,
and publishes and waits for the rendezvous and control files. It sits at the bottom: it imports
nothing of Lockstep but pipeline.utils, and every component asks it instead of joining paths.

  rundir.py   RunDir: every path, the token, the rendezvous / control operations
  files.py    publish (atomic) and wait_for of one small JSON file
  net.py      which address a component binds and publishes; a free port
"""

from pipeline.run.files import publish, wait_for
from pipeline.run.net import bind_address, free_port
from pipeline.run.rundir import EvalDir, RunDir

__all__ = ["RunDir", "EvalDir", "publish", "wait_for", "bind_address", "free_port"]
