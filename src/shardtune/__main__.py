import sys

from shardtune.cli.main import main
from shardtune.rank.lifecycle import leave_rank

code = main()
leave_rank(code)  # a rank of a launcher: a deterministic end, not the interpreter's teardown
sys.exit(code)
