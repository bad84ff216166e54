"""The name torch.distributed knows the backend by (``init_process_group("redsock")``).

Its own module so that the registration (cheap, runs inside ``import torch``) and the
process group (heavy, imported when a group is made) both read it without importing each other.
"""

BACKEND_NAME = "redsock"
