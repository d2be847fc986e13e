"""What training minimises: `CrossEntropy` and `DPO`, the objectives train.loop.fit() takes. They turn a
batch into gradients and the loss fields of the metrics record, and evaluate held-out batches. The
cross-entropy's math (per-position weights over the engine's losses) is the model's, in
nanoeuler/model/losses.py; the preference objective's is here, below the DPO class:

DPO (Rafailov et al. 2023): a sequence's log-probability is pi_s = -sum of head 0's losses over its
supervised targets; with pairs (chosen c, rejected r) and the reference model's ref,

    z_i  = beta * ((pi_c - ref_c) - (pi_r - ref_r))
    loss = (1 / pairs) * sum_i -log sigmoid(z_i)  +  alpha * (sum_i -pi_c,i) / chosen_tokens

the second term RPO's (Pang et al. 2024; TRL's `rpo_alpha`): the chosen replies' NLL per token, which
keeps DPO from winning its margin by pushing the rejected reply down onto unrelated tokens (docs/dpo.md);
alpha 0 is plain DPO. d loss / d loss_s[0, n] = -d loss / d pi_s = beta * sigmoid(-z) / pairs + alpha /
chosen_tokens on a chosen row's positions, -beta * sigmoid(-z) / pairs on a rejected row's, 0 for heads
1..K-1.
"""
import numpy as np

from nanoeuler.model.losses import bits_per_byte, cross_entropy_backward, sequence_logprobs, supervised_counts
from nanoeuler.parallel.comm import SingleProcess


class CrossEntropy:
    """Pretraining's and SFT's objective for fit(): a batch is (inputs, targets), split into hp.grad_accum
    passes normalised by the supervised targets of the global batch (every rank's, through comm).

    train_step (of both objectives) returns this rank's share of each loss field, shares that add up over the
    ranks (fit() sums them with the other per-step numbers in one collective), and this rank's tokens."""
    ylabel = "loss (nats/token, head 0)"

    def __init__(self, comm=None, every_target=False):
        """every_target: every rank's batches supervise every position (pretraining's windows), so the global
        counts are this rank's times the ranks, with no collective."""
        self.comm, self.every_target = comm or SingleProcess(), every_target

    def train_step(self, eng, batch, hp):
        """Gradients of this rank's batch into eng.grads; (this rank's shares of the record's loss fields, which
        add up over the ranks to the global batch's, as scalars on the engine's device, and this rank's tokens).
        The global target counts are summed on the device: the host waits for nothing."""
        inputs, targets = batch
        counts = supervised_counts(targets)
        if self.every_target:
            assert counts.min() == targets[0].size, "a batch with unsupervised targets"
            counts = counts * self.comm.world_size
        else:
            counts = self.comm.all_reduce_sum(eng.xp.asarray(counts))
        loss = loss0 = 0.0
        passes = np.array_split(np.arange(len(inputs)), hp.grad_accum)
        for i, rows in enumerate(passes):
            part, part0 = cross_entropy_backward(eng, inputs[rows], targets[:, rows], counts, accumulate=i > 0,
                                                 final=i == len(passes) - 1, on_device=True)
            loss, loss0 = loss + part, loss0 + part0
        return dict(loss=loss0, loss_all_heads=loss), inputs.size

    def evaluate(self, eng, batches):
        val_loss, val_bpb = bits_per_byte(eng, batches)
        return dict(val_loss=val_loss, val_bpb=val_bpb)

    def eval_text(self, record):
        return (f"train loss {record['loss']:.4f}, val loss {record['val_loss']:.4f}, val {record['val_bpb']:.4f} "
                "bits/byte")

    def plot_title(self, record):
        return f"val {record['val_bpb']:.3f} bits/byte"


# ------------------------------------------------------------------------------------------------- DPO
class DPO:
    """The preference objective for fit(): a batch is (inputs, targets, reference log-probs) of P pairs;
    gradient accumulation splits the pairs into hp.grad_accum groups, each normalised by all P pairs and all
    chosen tokens. alpha > 0: RPO (DPO + alpha * the chosen replies' NLL per token); 0: plain DPO."""
    ylabel = "loss (nats/pair)"

    def __init__(self, beta, alpha=0.0, comm=None):
        self.beta, self.alpha = beta, alpha
        self.comm = comm or SingleProcess()

    def train_step(self, eng, batch, hp):
        """Gradients of this rank's pairs into eng.grads, normalised by the pairs and chosen tokens of every
        rank; (this rank's shares of the loss, reward accuracy and margin, which add up over the ranks, and its
        tokens)."""
        inputs, targets, ref = batch
        P = len(inputs) // 2
        pairs = P * self.comm.world_size  # every rank holds the same number of pairs (PairBatches)
        tokens = int(self.comm.all_reduce_sum(np.array([chosen_tokens(targets)], dtype=np.float64))[0])
        loss, zs = 0.0, []
        groups = np.array_split(np.arange(P), min(hp.grad_accum, P))
        for i, rows in enumerate(groups):
            both = np.concatenate([rows, rows + P])
            part, z = dpo_backward(eng, inputs[both], targets[:, both], ref[both], self.beta, pairs=pairs,
                                   accumulate=i > 0, alpha=self.alpha, tokens=tokens, final=i == len(groups) - 1)
            loss += part
            zs.append(z)
        z = np.concatenate(zs)
        wins = (z > 0).sum() + 0.5 * (z == 0).sum()  # tie_accuracy's, over every rank's pairs
        return dict(loss=loss, reward_accuracy=float(wins / pairs), reward_margin=float(z.sum() / pairs)), inputs.size

    def evaluate(self, eng, batches):
        """The held-out objective, reward accuracy and margin, and the mean log-probability of the chosen and
        the rejected replies under the policy minus under the reference (nats per reply). The objective is the
        training one over all the held-out pairs at once: the DPO term's mean over the pairs plus alpha times
        the chosen replies' NLL per chosen token of them all, whatever batches they are scored in (so the same
        at any batch size or world size)."""
        loss, nll, pairs, tokens, deltas = 0.0, 0.0, 0, 0, []
        for inputs, targets, ref in batches:
            pi = sequence_logprobs(eng, inputs, targets)
            P = len(pi) // 2
            loss += dpo_loss(dpo_margins(pi, ref, self.beta), 1)
            nll -= pi[:P].sum()
            pairs, tokens = pairs + P, tokens + chosen_tokens(targets)
            deltas.append((pi - ref).reshape(2, P))
        delta = np.concatenate(deltas, axis=1)
        z = self.beta * (delta[0] - delta[1])
        val_loss = loss / pairs + (self.alpha * nll / tokens if self.alpha else 0.0)
        return dict(val_loss=float(val_loss), val_reward_accuracy=tie_accuracy(z), val_reward_margin=float(z.mean()),
                    val_chosen_logp_delta=float(delta[0].mean()), val_rejected_logp_delta=float(delta[1].mean()))

    def eval_text(self, record):
        return (f"train loss {record['loss']:.4f}, val loss {record['val_loss']:.4f}, reward accuracy "
                f"{record['val_reward_accuracy']:.1%}, margin {record['val_reward_margin']:.3f}, log-prob vs "
                f"reference: chosen {record['val_chosen_logp_delta']:+.2f}, rejected "
                f"{record['val_rejected_logp_delta']:+.2f}")

    def plot_title(self, record):
        return f"val reward accuracy {record['val_reward_accuracy']:.1%}"


# ------------------------------------------------------------------------------------------- DPO's math
def dpo_margins(pi, ref, beta):
    """z (P,) of rows (2P,) holding the P chosen sequences, then the P rejected ones."""
    P = len(pi) // 2
    return beta * ((pi[:P] - ref[:P]) - (pi[P:] - ref[P:]))


def chosen_tokens(targets):
    """(2P,) rows -> the number of head-0 targets of the P chosen rows (what RPO's NLL is averaged over)."""
    targets = np.asarray(targets)
    return int((targets[0, :targets.shape[1] // 2] >= 0).sum())


def dpo_loss(z, pairs, pi=None, alpha=0.0, tokens=1):
    """sum of -log sigmoid(z) (stable for any z) over the pairs, divided by `pairs`; alpha > 0 adds RPO's
    alpha * (the chosen rows' summed -log-probability, pi (2P,)'s first half) / tokens."""
    loss = np.logaddexp(0.0, -z).sum() / pairs
    return float(loss - alpha * pi[:len(pi) // 2].sum() / tokens if alpha else loss)


def dpo_row_weights(z, beta, pairs, alpha=0.0, tokens=1):
    """(2P,): d loss / d loss_s of each row's head-0 cross-entropy, chosen rows first: DPO's
    beta * sigmoid(-z) / pairs, and on the chosen rows RPO's alpha / tokens."""
    w = beta * (1.0 / (1.0 + np.exp(z))) / pairs  # beta * sigmoid(-z) / pairs
    return np.concatenate([w + alpha / tokens, -w])


def dpo_backward(eng, inputs, targets, ref, beta, pairs=None, accumulate=False, alpha=0.0, tokens=None,
                 final=True):
    """The preference objective's gradients of P pairs into eng.grads: rows 0..P-1 of inputs (2P, T) the chosen
    sequences, rows P..2P-1 the rejected ones, targets (K, 2P, T) masking all but each response and its </s>
    with -1, ref (2P,) the reference model's sequence log-probabilities. pairs and tokens: what the DPO term
    and the chosen NLL are averaged over (this batch's pairs and chosen tokens, or a larger batch's with
    accumulate). alpha: RPO's weight of the chosen replies' NLL (0: plain DPO). final: passed on to
    Engine.backward, False on a step's passes before its last. Returns (loss, z)."""
    B, T = np.shape(inputs)
    if B % 2:
        raise ValueError(f"DPO needs chosen and rejected rows in pairs, got {B} rows")
    pairs = B // 2 if pairs is None else pairs
    tokens = chosen_tokens(targets) if tokens is None else tokens
    # the forward first: the weights need every sequence's log-probability
    pi = sequence_logprobs(eng, inputs, targets)
    ref = np.asarray(ref, dtype=np.float64)
    z = dpo_margins(pi, ref, beta)
    weights = np.zeros((eng.cfg.mtp_heads, B, T))
    weights[0] = dpo_row_weights(z, beta, pairs, alpha, tokens)[:, None]
    eng.backward(weights.reshape(eng.cfg.mtp_heads, -1), accumulate, final=final)
    return dpo_loss(z, pairs, pi, alpha, tokens), z


def tie_accuracy(z):
    """The share of pairs whose chosen reward beats the rejected one (z > 0), a tie counting a half."""
    z = np.asarray(z)
    return float(((z > 0).sum() + 0.5 * (z == 0).sum()) / max(1, z.size))
