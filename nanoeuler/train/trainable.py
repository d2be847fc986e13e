"""What a training step trains and in which state: the one thing train.loop.fit() asks about the weights.

    trainable = Trainable(engine, hyper, comm, zero=False, resumed=ck)
    ...the objective's forward and backward passes on trainable.engine, into its gradients...
    numbers = trainable.step(lr, hyper, values)   # the ranks' sum, the clip, the AdamW step: queued
    params, (m, v), opt_step = trainable.state()  # what a checkpoint holds (a collective with ZeRO)

Today that is every weight of the engine: one flat float32 buffer of parameters (engine.params; in bf16 a
compute copy, engine.weights), one of gradients (engine.grads, which the objectives' backward passes fill),
AdamW's moments over all of them (model/optimizer.py) and, over N ranks, DataParallel's reduction and with
ZeRO-1 the moments' shards (train/distributed.py). What trains in another way plugs in here, behind the same
four members (engine, step, state, device_memory): adapters (LoRA) that train a few small tensors beside
frozen weights would hold their own flat parameters, gradients and moments and save those; ZeRO-2/3 would
shard the gradients and the weights. The loop, the objectives' shares and the checkpoints' format of the
training state stay as they are.
"""
from nanoeuler.model.optimizer import AdamW
from nanoeuler.train.distributed import DataParallel


class Trainable:
    """Every weight of `engine`, trained by AdamW (hyper's betas) over the ranks of `comm` (zero: ZeRO stage 1).
    resumed (a checkpoint read with its optimizer state): its moments and step count are taken; the engine
    already holds the weights to start from (Engine.load_params)."""

    def __init__(self, engine, hyper, comm, zero=False, resumed=None):
        optimizer = AdamW(engine, hyper.beta1, hyper.beta2)
        if resumed is not None:
            optimizer.load_state(*resumed.opt, resumed.train_state["opt_step"])
        self.engine = engine
        self.parallel = DataParallel(engine, optimizer, comm, zero=zero)
        del optimizer  # with ZeRO-1 the full moments it holds are dropped: that is the memory saved
        if self.parallel.zero and engine.device_memory() is not None:
            engine.xp.get_default_memory_pool().free_all_blocks()  # so that CuPy's pool hands them back

    @property
    def comm(self):
        return self.parallel.comm

    def step(self, lr, hyper, values):
        """The ranks' gradients summed, clipped to hyper.grad_clip by their global norm, one AdamW step (lr,
        hyper.weight_decay), all queued on the device; `values` (the step's losses, tokens, Ctrl-C flags) ride
        on the norm's collective. Returns a function that waits for that step alone: (the norm, the values
        summed over the ranks)."""
        return self.parallel.start_step(lr, hyper.weight_decay, hyper.grad_clip, values)

    def state(self):
        """(the weights, the optimizer's moments (m, v), its step count) as host arrays and an int, what a
        checkpoint holds for --resume; every rank must call it (with ZeRO the pieces are gathered)."""
        params, moments = self.parallel.params_numpy(), self.parallel.opt_state_numpy()
        return params, moments, self.parallel.optimizer.steps

    def device_memory(self):
        """Bytes on the GPU beside the engine's pool (the copy engines' buffers of the reduction)."""
        return self.parallel.device_memory()
