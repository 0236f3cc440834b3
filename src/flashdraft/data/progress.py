"""A progress bar for the record-by-record data commands (regenerate, synthesize), on stderr; the
libraries' own bars switched off (`quiet_libraries`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TimeRemainingColumn
from rich.text import Text


@contextmanager
def progress_bar(label: str, total: int, enabled: bool) -> Iterator[Callable[[], None]]:
    """A rich progress bar with records/s and ETA; yields `advance()`, which counts one record."""
    bar = Progress(
        label,
        BarColumn(),
        MofNCompleteColumn(),
        _RateColumn(),
        "ETA",
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not enabled,
    )
    task = bar.add_task(label, total=total)
    with bar:
        yield lambda: bar.advance(task)


class _RateColumn(ProgressColumn):
    def render(self, task) -> Text:
        return Text(f"{task.speed or 0:.2f} rec/s")


def quiet_libraries() -> None:
    """flashdraft's own progress display only: transformers' bars (loading weights, converting a GGUF)
    and datasets' (tokenize, saving a dataset) off for the rest of the process. `--verbose` keeps them."""
    import datasets
    import transformers

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
