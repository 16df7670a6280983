import glob
import os

import torch


class CheckpointSaver:
    """Keeps the best `max_history` checkpoints by metric; made only on the primary process."""

    def __init__(self, model, optimizer, checkpoint_dir, max_history=5):
        self.model = model
        self.optimizer = optimizer
        self.checkpoint_dir = checkpoint_dir
        self.max_history = max_history
        self.history = []

    def _save(self, path, epoch, metric):
        state = {"epoch": epoch, "state_dict": self.model.state_dict(),
                 "optimizer": self.optimizer.state_dict(), "metric": metric}
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)

    def save_checkpoint(self, epoch, metric):
        path = os.path.join(self.checkpoint_dir, f"checkpoint-{epoch}.pth.tar")
        self._save(path, epoch, metric)
        self.history = sorted([*self.history, (metric, path)])[: self.max_history]
        for old in glob.glob(os.path.join(self.checkpoint_dir, "checkpoint-*.pth.tar")):
            if old not in [p for _, p in self.history]:
                os.remove(old)
        return self.history[0]


def export_torchscript(model, path):
    """A utility for after training (not called by the training script)."""
    scripted = torch.jit.script(model)
    torch.save(scripted.state_dict(), path)
