import sys

from dualvllm.cli import main

sys.exit(main())
