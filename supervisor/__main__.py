import sys

from supervisor.cli import main

if __name__ == "__main__":  # not when a spawned worker (the gateway's parser pool) imports it
    sys.exit(main())
