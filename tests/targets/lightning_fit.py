"""A real Lightning ``Trainer.fit`` that knows nothing of dlwatch (for `dlwatch run`).

usage: lightning_fit.py EPOCHS [STALL_EPOCHS STALL_S]

A train loader (2 workers, 8 batches) and a validation loader (1 worker, 2 batches);
Lightning iterates both itself (sanity check, then each epoch's training and validation).
In each training epoch named in STALL_EPOCHS (comma-separated), a worker sleeps STALL_S
seconds in ``__getitem__`` of sample 9: a real worker stall.  Prints ``DONE global_step N``.
"""

import sys
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset


class Samples(Dataset):
    def __init__(self, n, stall_epochs=(), stall_s=0.0):
        self.n, self.stall_epochs, self.stall_s = n, stall_epochs, stall_s
        self.epoch = 0  # set by the module as each training epoch starts: forked workers copy it

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == 9 and self.epoch in self.stall_epochs:
            time.sleep(self.stall_s)
        return torch.tensor([float(i), 1.0, -1.0])


class Tiny(L.LightningModule):
    def __init__(self, train_set):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)
        self.train_set = train_set

    def on_train_epoch_start(self):
        self.train_set.epoch = self.current_epoch

    def training_step(self, batch, index):
        return self.lin(batch).pow(2).mean()

    def validation_step(self, batch, index):
        self.lin(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main():
    epochs = int(sys.argv[1])
    stall_epochs = {int(e) for e in sys.argv[2].split(",") if e} if len(sys.argv) > 2 else set()
    stall_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    train_set = Samples(16, stall_epochs, stall_s)
    train = DataLoader(train_set, batch_size=2, num_workers=2)
    val = DataLoader(Samples(6), batch_size=3, num_workers=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Tiny(train_set)
    trainer.fit(model, train, val)
    print(f"DONE global_step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
