"""Published Chinchilla-style results, drawn and tabulated beside a fit for reference.

Losses are cross-entropy in nats per token: on DeepMind's MassiveText with its tokenizer for
Hoffmann et al. and for Besiroglu et al. (who refit Hoffmann et al.'s runs, read off its figure 4),
on C4 with the GPT-2 tokenizer for Muennighoff et al. So their E, A and B do not carry over to other
data, and neither do N_opt and D_opt at a given C: a published law is drawn beside a fit only when
the fit's table names the law's data set (a ``dataset`` column, ``comparable``), which the lab's
runs never do; otherwise it is listed in a note. E, A, B, alpha, beta and the exponents are
tabulated in the report either way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PublishedLaw:
    """L(N, D) = E + A/N^alpha + B/D^beta as published."""

    name: str
    citation: str
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    dataset: str = "MassiveText"  # the data and tokenizer its losses are measured on
    # Data-constrained law only (Muennighoff et al.): the decay constants of repeated data and excess parameters.
    r_d_star: float | None = None
    r_n_star: float | None = None

    def as_dict(self) -> dict[str, float]:
        return {"E": self.E, "A": self.A, "B": self.B, "alpha": self.alpha, "beta": self.beta}

    @property
    def a(self) -> float:
        return self.beta / (self.alpha + self.beta)


HOFFMANN = "Hoffmann et al. (2022), Training Compute-Optimal Large Language Models, arXiv:2203.15556"
BESIROGLU = "Besiroglu, Erdil, Barnett & You (2024), Chinchilla Scaling: A replication attempt, arXiv:2404.10102"
KAPLAN = "Kaplan et al. (2020), Scaling Laws for Neural Language Models, arXiv:2001.08361"
MUENNIGHOFF = ("Muennighoff, Rush, Barak, Le Scao, Piktus, Tazi, Pyysalo, Wolf & Raffel (2023), Scaling "
               "Data-Constrained Language Models, arXiv:2305.16264")

LAWS = (
    PublishedLaw("Chinchilla approach 3", f"{HOFFMANN}, section 3.3 and appendix D.2",
                 E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28),
    PublishedLaw("Epoch AI replication of approach 3", f"{BESIROGLU}, equation 4",
                 E=1.82, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658),
    PublishedLaw("Data-constrained law", f"{MUENNIGHOFF}; fitted values as the authors' repository "
                 "huggingface/datablations lists them (A = e^6.2554, B = e^7.3050, E = e^0.6255)", E=1.87, A=521.0,
                 B=1488.0,
                 alpha=0.353, beta=0.353, dataset="C4", r_d_star=15.387, r_n_star=5.309),
)

def comparable(law: PublishedLaw, dataset: str | None) -> bool:
    """Whether runs on ``dataset`` (None: not named) have losses in the same units as ``law``."""
    return dataset is not None and dataset.strip().casefold() == law.dataset.casefold()


def listed_note(laws: tuple[PublishedLaw, ...] | list[PublishedLaw], dataset: str | None) -> str:
    """One line naming published laws that are not drawn, and why."""
    names = "; ".join(f"{law.name} (a = {law.a:.3g}, {law.dataset})" for law in laws)
    data = f"'{dataset}'" if dataset else "a data set the table does not name"
    return (f"Published laws not drawn, since their losses are on another data set with its tokenizer and these "
            f"runs on {data}: {names}.")


# Hoffmann et al. (2022), Table 3: (row, a, a interval, b, b interval), N_opt ~ C^a, D_opt ~ C^b.
TABLE3 = (
    ("Chinchilla approach 1 (training-curve envelope)", 0.50, (0.488, 0.502), 0.50, (0.501, 0.512)),
    ("Chinchilla approach 2 (IsoFLOP profiles)", 0.49, (0.462, 0.534), 0.51, (0.483, 0.529)),
    ("Chinchilla approach 3 (parametric loss)", 0.46, (0.454, 0.455), 0.54, (0.542, 0.543)),
    ("Kaplan et al. (2020)", 0.73, None, 0.27, None),
)
