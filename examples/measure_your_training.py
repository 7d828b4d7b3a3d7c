import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddp.callbacks import CommTimer  # importing lightning_ddp registers "bucketed_ddp" with Lightning


class Classifier(L.LightningModule):  # a plain LightningModule: nothing in it knows about lightning_ddp
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    data = DataLoader(TensorDataset(torch.randn(2048, 32), torch.randint(0, 4, (2048,))), batch_size=32)
    # measures every 2nd step (comm/exposed_ms, comm/share, ...): 20 steps, the first 5 left out of the summary
    trainer = L.Trainer(strategy="bucketed_ddp", devices=2, accelerator="cpu", max_steps=40, log_every_n_steps=2,
                        callbacks=[CommTimer()], default_root_dir="logs")  # logs/lightning_logs/version_N
    trainer.fit(Classifier(), data)
