"""ddp-launch: start torchrun on every node of an Ansible inventory at once."""
