"""Number formats shared by the reports' words and the renderers (no rich, no numpy)."""

from __future__ import annotations


def percent(share: float) -> str:
    """A carried share as the text shows it: 0.18 → '18.0%', 1.2e-7 → '1.20e-05%', 0 → '0'."""
    return "0" if share == 0 else f"{100 * share:#.3g}%"
