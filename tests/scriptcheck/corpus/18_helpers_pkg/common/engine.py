import torch

from .dist_utils import is_main_process


def train_one_epoch(model, loader, opt, device):
    model.train()
    for step, (x, y) in enumerate(loader):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if is_main_process() and step % 50 == 0:
            print(f"step {step} loss {loss.item():.4f}")
