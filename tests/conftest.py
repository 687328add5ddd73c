import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # worker modules must be importable in spawned workers
