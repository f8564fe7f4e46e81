import sys

from rollout_actors.inference.standin.server import main

sys.exit(main())
