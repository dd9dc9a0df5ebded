"""Losses whose pseudo-labels come from a vision-language model's image-text similarity, read from the cache's
text side (docs/losses.md, "Vision-language pseudo-labels"): VLPL's EM_PL and AEVLP's GPR.

Both take their pseudo-labels once, at build time, from `train_similarity` (`[N_train, C]`, the cosine of each
training row's CLIP image embedding with each class's text embedding) and keep them as a per-row buffer: the
vision-language model is frozen, so its pseudo-labels never change. An observed label always wins over a
pseudo-label, and an observed negative (`z = -1`, partial labels only) is a known negative, `nl(1 - p)`.
"""

from __future__ import annotations

import math
import torch

from spml_cache.runtime.errors import SpmlError
from spml_cache.losses.base import Fidelity, Loss, as_tensor_like, head_vector, register, rows_for_heads
from spml_cache.losses.estimating import _ExpectedPositivesLoss, expected_positives
from spml_cache.losses.generalized import GeneralizedRobust
from spml_cache.runtime.registry import Param

VLPL_ALPHA = {"voc": 0.2, "coco": 0.1, "nus": 0.1, "cub": 0.01}
# AEVLP's configs/<dataset>.json (and coco.json): beta = (w0, wT, b0, bT), lam = (lambda1, lambda2), reg, the
# pseudo-labelling's eta, threshold, temperature and negative_ratio; top_k from their config.py.
GPR_DATASETS = {
    "voc": {"wT": 2.0, "bT": -2.0, "lambda1": 0.7, "lambda2": 0.4, "reg": 0.05, "eta": 0.0, "threshold": 0.5,
            "negative_ratio": 0.2},
    "coco": {"wT": 10.0, "bT": -8.0, "lambda1": 0.7, "lambda2": 0.5, "reg": 0.001, "eta": 0.3, "threshold": 0.5,
             "negative_ratio": 0.3},
    "nus": {"wT": 10.0, "bT": -8.0, "lambda1": 0.7, "lambda2": 0.5, "reg": 0.001, "eta": 0.3, "threshold": 0.6,
            "negative_ratio": 0.2},
    "cub": {"wT": 10.0, "bT": -8.0, "q3": 1.5, "lambda1": 0.8, "lambda2": 0.2, "reg": 0.01, "temperature": 0.1,
            "eta": 0.005, "threshold": 0.005, "top_k": 32, "negative_ratio": 0.2},
}


def class_softmax(similarity: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax over the classes (last dim) of similarity / temperature."""
    return torch.softmax(similarity.double() / temperature, dim=-1)


def _for_heads(labels: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Per-row labels `[N, C]` as the per-head buffer `[K, N, C]` every head reads (the same for all heads)."""
    return labels.unsqueeze(0).expand(num_heads, *labels.shape).contiguous()


@register
class VisionLanguagePseudoLabels(Loss):
    """VLPL's EM_PL. A pseudo-positive is an unobserved entry whose class softmax of `similarity / temperature`
    exceeds `threshold`; its term is `beta [rho nl(p) + (1 - rho) nl(1 - p)]`. Observed positives `nl(p)`; the
    other unobserved entries EM's `-alpha H(p)`. The authors run no warm-up (warmup_epoch 0) and use no negative
    pseudo-labels (their negative branch is commented out), so neither is offered."""

    name = "vlpl"
    display_name = "VLPL"
    observed_negative = "nl(1-p), never a pseudo-positive"
    needs_similarity = True
    authors_log_eps = 1e-5  # Xing et al.'s code: -log(p + 1e-5)
    description = "EM loss plus CLIP pseudo-positives (class softmax of image-text similarity above a threshold)"
    reference = "Xing et al., VLPL, 2023, Sec. 3 (EM_PL loss); their losses.py and main_clip.py defaults"
    defaults = {"alpha": 0.1, "beta": 0.7, "rho": 0.9, "temperature": 0.01, "threshold": 0.3}
    dataset_defaults = {dataset: {"alpha": alpha} for dataset, alpha in VLPL_ALPHA.items()}
    per_head = ("alpha", "beta", "rho")
    params = (Param.between("alpha", 0.0, math.inf, "[)"), Param.between("beta", 0.0, math.inf, "[)"),
              Param.between("rho", 0.0, 1.0, "[]"), Param.between("temperature", 0.0, math.inf, "()"),
              Param.between("threshold", 0.0, 1.0, "[)"))
    state = "pseudo_positive [K, N_train, C]: fixed CLIP pseudo-positives"
    row_buffers = ("pseudo_positive",)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)  # a loss with per-example state: the base refuses it without train_observed
        scores = class_softmax(self.train_similarity.cpu(), self.temperature)  # built on the host, moved with .to()
        pseudo = (scores > self.threshold) & (self.train_observed.cpu() == 0)
        self.register_buffer("pseudo_positive", _for_heads(pseudo, self.num_heads), persistent=False)

    def equation(self, x, observed, *, labels=None, index=None):
        pseudo = rows_for_heads(self.pseudo_positive, index, x.logits)
        pseudo_term = self.beta * (self.rho * x.nl_p + (1 - self.rho) * x.nl_1mp)
        return x.mean(x.known_or(observed, x.where(pseudo, pseudo_term, -self.alpha * x.entropy)))


def aevlp_pseudo_labels(similarity: torch.Tensor, crops: torch.Tensor | None, observed: torch.Tensor, *,
                        temperature: float, eta: float, threshold: float, top_k: int, negatives: int) -> torch.Tensor:
    """AEVLP's pseudo-labels, int8 `[N, C]`: 1 positive, -1 negative, 0 none.

    Scores are class softmaxes of `similarity / temperature`: `g` of the whole image and, with a crop grid, `l` of
    each crop. Per image, `eta_i = min(g of its observed positive, eta)`; per class the crops' max is kept where
    it exceeds `eta_i`, else their min; `final = (g + that) / 2`, `negative score = (g + mean of l) / 2`. Without
    crops both are `g`. Positives: the `top_k` highest `final` that reach `threshold`; negatives: the `negatives`
    lowest negative scores (they win over a positive, as in the authors' code)."""
    g = class_softmax(similarity, temperature)
    if crops is None:
        final = negative_score = g
    else:
        local = class_softmax(crops, temperature)  # [N, G*G, C]
        top, bottom = local.max(dim=1).values, local.min(dim=1).values
        positive_score = (g * (observed == 1)).max(dim=1, keepdim=True).values
        eta_i = positive_score.clamp(max=eta)
        final = (g + torch.where(top > eta_i, top, bottom)) / 2
        negative_score = (g + local.mean(dim=1)) / 2
    labels = torch.zeros(g.shape, dtype=torch.int8)
    top_k = min(int(top_k), g.shape[1])
    values, chosen = final.topk(top_k, dim=1)
    labels.scatter_(1, chosen, (values >= threshold).to(torch.int8))
    if negatives > 0:
        lowest = negative_score.topk(min(negatives, g.shape[1]), dim=1, largest=False).indices
        labels.scatter_(1, lowest, torch.full(lowest.shape, -1, dtype=torch.int8))
    return labels


@register
class GeneralizedPseudoLabelRobust(GeneralizedRobust, _ExpectedPositivesLoss):
    """AEVLP's GPR loss: GR on the unobserved entries without a pseudo-label (its schedules, `k(p)` and `v(p)`),
    `(1 - clip(v, 1 - lambda1, 1 - lambda2)) [rho nl(p) + (1 - rho) nl(1 - p)]` on pseudo-positives, `v nl(1 - p)`
    on pseudo-negatives, plus `reg` times EPR's `R_k`. Pseudo-labels: `aevlp_pseudo_labels`, from the crop grid
    where the cache stores one (`extract --crops G`), else from the whole image alone. `--fidelity authors`: their
    code writes the negative pseudo-labels as 0, so those entries keep GR's term (no pseudo-negatives), and a
    pseudo-positive among them loses its label as well."""

    name = "gpr"
    display_name = "GPR"
    observed_negative = "nl(1-p), never a pseudo-label"
    needs_similarity = True
    authors_log_eps = 1e-7  # Tran et al.'s code, as GR's: -log(p + 1e-7)
    authors_early_stop = ("drop", 2.0)  # their train.py: stop once val mAP falls 2 below its best (or 2 epochs)
    authors_defaults = {}
    description = "GR loss plus CLIP pseudo-labels (crop grid if cached) weighted by v(p), and EPR"
    reference = "Tran et al., AEVLP, ICCV 2025, Sec. 3 (GPR loss, pseudo-labels); their configs/*.json"
    defaults = {
        **GeneralizedRobust.defaults, **_ExpectedPositivesLoss.defaults,
        "lambda1": 0.7, "lambda2": 0.5, "rho": 0.9, "reg": 0.001,
        "temperature": 0.01, "threshold": 0.5, "eta": 0.3, "top_k": 3, "negative_ratio": 0.3,
    }
    derived = _ExpectedPositivesLoss.derived
    # Class defaults (a custom dataset's) are COCO's; `k` as EPR's, the dataset's expected positives per image.
    dataset_defaults = {dataset: {**values, **_ExpectedPositivesLoss.dataset_defaults.get(dataset, {})}
                        for dataset, values in GPR_DATASETS.items()}
    per_head = GeneralizedRobust.per_head + ("lambda1", "lambda2", "rho", "reg", "k")
    params = (*GeneralizedRobust.params, Param.between("lambda1", 0.0, 1.0, "[]"),
              Param.between("lambda2", 0.0, 1.0, "[]"), Param.between("rho", 0.0, 1.0, "[]"),
              Param.between("reg", 0.0, math.inf, "[)"), Param.between("temperature", 0.0, math.inf, "()"),
              Param.between("eta", 0.0, 1.0, "[]"), Param.between("top_k", 1.0, math.inf, "[)"),
              Param.between("negative_ratio", 0.0, 1.0, "[)"))
    state = "pseudo_label [K, N_train, C]: fixed CLIP pseudo-labels, 1 / -1 / 0"
    row_buffers = ("pseudo_label",)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)  # a loss with per-example state: the base refuses it without train_observed
        for low, high in zip(_values_of(self.lambda2), _values_of(self.lambda1)):
            if low > high:
                raise SpmlError(f"loss 'gpr': lambda2={low:g} exceeds lambda1={high:g}; the pseudo-positive weight"
                                " is clipped to [1 - lambda1, 1 - lambda2]: fix --hp lambda1= / lambda2=")
        if self.top_k != int(self.top_k):
            raise SpmlError(f"loss 'gpr': top_k={self.top_k} must be a whole number of classes: fix --hp top_k=")
        self.set_hparam("top_k", int(self.top_k))
        negatives = int(self.negative_ratio * self.num_classes)
        crops = None if self.train_crop_similarity is None else self.train_crop_similarity.cpu()
        observed = self.train_observed.cpu()  # built on the host, moved with .to()
        labels = aevlp_pseudo_labels(self.train_similarity.cpu(), crops, observed, temperature=self.temperature,
                                     eta=self.eta, threshold=self.threshold, top_k=self.top_k, negatives=negatives)
        if self.fidelity is Fidelity.AUTHORS:
            # their code writes the negatives as 0, after the positives: a positive among them is cleared too
            labels[labels == -1] = 0
        labels[observed != 0] = 0  # an observed label wins
        self.register_buffer("pseudo_label", _for_heads(labels, self.num_heads), persistent=False)

    def equation(self, x, observed, *, labels=None, index=None):
        pseudo = rows_for_heads(self.pseudo_label, index, x.logits)
        v, missing = self.missing(x)
        weight = 1 - torch.minimum(torch.maximum(v, as_tensor_like(1 - self.lambda1, v)), as_tensor_like(1 - self.lambda2, v))
        positive = weight * (self.rho * x.nl_p + (1 - self.rho) * x.nl_1mp)
        unobserved = x.where(pseudo == 1, positive, x.where(pseudo == -1, v * x.nl_1mp, missing))
        regularizer = expected_positives(x, head_vector(self.k), weight=head_vector(self.reg))
        return x.mean(x.known_or(observed, unobserved)) + regularizer


def _values_of(value) -> list[float]:
    return value.reshape(-1).tolist() if isinstance(value, torch.Tensor) else [value]


