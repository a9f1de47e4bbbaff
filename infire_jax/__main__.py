import sys

from infire_jax.cli import main

sys.exit(main())
