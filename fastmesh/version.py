__version__ = "0.1.0"

# The torch releases every change is tested on: CI's main leg (2.14), its CPU-only leg (2.13) and its oldest-torch leg
# (2.11, also the GPU machine's). Others within pyproject's range install and build, untested; README, "Install and
# run", says which and why.
TESTED_TORCH = ("2.11", "2.13", "2.14")
