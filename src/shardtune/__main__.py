import sys

from shardtune.cli.main import main

sys.exit(main())
