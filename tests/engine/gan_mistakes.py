"""The bundled GAN with a manual step written wrongly, as a user might (``--mistake``):
``no-update`` never calls ``optimizer_step``; ``direct`` calls ``loss.backward()`` and
``optimizer.step()`` itself; ``no-backward`` steps without ``backward``."""

from dataclasses import dataclass, field

from dmltrain import register_experiment
from dmltrain_experiments.mnist_gan import GanOptions, GanTrainer, real_or_fake


@dataclass(frozen=True)
class MistakeOptions(GanOptions):
    mistake: str = field(default="none", metadata={"help": "none, no-update, direct, no-backward"})


class Mistaken(GanTrainer):
    name = "gan-mistakes"

    def train_step(self, batch):
        mistake = self.options.mistake
        if mistake == "none":
            return super().train_step(batch)
        real, _ = batch
        d_opt = self.optimizers[1]
        d_loss = real_or_fake(self.model.discriminator(real), True)
        if mistake == "direct":
            d_loss.backward()
            d_opt.step()
        elif mistake == "no-backward":
            self.optimizer_step(d_opt)
        return d_loss.detach()


EXPERIMENT = register_experiment("gan-mistakes", Mistaken, MistakeOptions)
