"""Ansible vaults in the inventory, read as ansible-playbook reads them without a prompt (issue #48):
the DataLoader that inventory.load_nodes and slurm/settings.py parse with, and the one line when a
vault cannot be opened."""

from __future__ import annotations

import functools
from typing import Any

from ddp_train.launch.errors import LaunchError, one_line


def data_loader() -> Any:
    """Ansible's DataLoader holding the vault passwords ansible-playbook would use without a prompt:
    ansible.cfg's vault_password_file / vault_identity_list, or ANSIBLE_VAULT_PASSWORD_FILE /
    ANSIBLE_VAULT_IDENTITY_LIST (ansible/cli/__init__.py CLI.setup_vault_secrets, auto_prompt=False;
    `@prompt` identities are left out: ddp-launch never prompts). LaunchError (one line) when a password
    file named there cannot be read."""
    from ansible.parsing.dataloader import DataLoader

    loader = DataLoader()
    loader.set_vault_secrets(_vault_secrets(*_vault_config()))
    return loader


def _vault_config() -> tuple[tuple[str, ...], str | None]:
    from ansible import constants

    prompts = ("@prompt", "@prompt_ask_vault_pass")
    ids = tuple(i for i in constants.DEFAULT_VAULT_IDENTITY_LIST if not i.endswith(prompts))
    return ids, constants.DEFAULT_VAULT_PASSWORD_FILE


@functools.lru_cache(maxsize=4)
def _vault_secrets(ids: tuple[str, ...], password_file: str | None) -> list[Any]:
    """Read once per process: a password file that is a script runs once, not at every inventory read."""
    from ansible.cli import CLI
    from ansible.errors import AnsibleError
    from ansible.parsing.dataloader import DataLoader

    try:
        return list(
            CLI.setup_vault_secrets(DataLoader(), list(ids), auto_prompt=False, initialize_context=False)
        )
    except AnsibleError as e:
        where = f"vault_password_file {password_file}" if password_file else "vault_identity_list"
        raise LaunchError(f"{where}: {one_line(str(getattr(e, 'message', None) or e), None)}") from None


def failure(where: str, err: Exception) -> str:
    """One line for an inventory file Ansible could not read (most often a vault with no password)."""
    text = one_line(str(getattr(err, "message", None) or err), None).rstrip(".")
    if "vault" not in text.lower() and "decrypt" not in text.lower():
        return f"inventory {where}: {text}"
    if _vault_secrets(*_vault_config()):
        return f"inventory {where}: {text}: the vault password ddp-launch was given does not open it"
    return (
        f"inventory {where}: {text}; ddp-launch reads a vault as ansible-playbook does without a prompt: "
        "set vault_password_file in ansible.cfg or ANSIBLE_VAULT_PASSWORD_FILE (docs/security.md)"
    )
