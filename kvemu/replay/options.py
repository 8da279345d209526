"""What a replay can be told: kvemu/replay_options.py, outside this package so that the command
line builds `kvemu replay`'s options from its table without importing the replay."""

from ..replay_options import *  # noqa: F401,F403
from ..replay_options import __all__  # noqa: F401
