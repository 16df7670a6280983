"""ddp-train: provision GPU hosts with Ansible and run PyTorch DDP across them from one inventory."""

__version__ = "0.1.0"
