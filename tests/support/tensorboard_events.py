"""Read back what the CommTimer's TensorBoard views wrote into a run's event files: its custom-scalars layout and its
hparams record (values and metric names), as TensorBoard's plugins read them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class RunViews:
    """One run directory's views: ``layout`` category -> chart title -> tag regexes; ``hparams`` name -> value;
    ``metrics`` the HPARAMS metric tags its experiment record names; ``scalars`` tag -> [(step, value), ...]."""

    layout: dict[str, dict[str, list[str]]]
    hparams: dict[str, object]
    metrics: list[str]
    scalars: dict[str, list[tuple[int, float]]]


def read_views(run_dir: Path) -> RunViews:
    """The views of the run whose event file(s) lie directly in ``run_dir`` (empty where nothing was written)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2
    from tensorboard.plugins.hparams import metadata

    assert list(run_dir.glob("events.out.tfevents.*")), f"no TensorBoard event file in {run_dir}"
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    layout: dict[str, dict[str, list[str]]] = {}
    if "custom_scalars__config__" in tags["tensors"]:
        (event,) = events.Tensors("custom_scalars__config__")  # written once per run
        proto = layout_pb2.Layout()
        proto.ParseFromString(event.tensor_proto.string_val[0])
        layout = {c.title: {chart.title: list(chart.multiline.tag) for chart in c.chart} for c in proto.category}
    hparams: dict[str, object] = {}
    metrics: list[str] = []
    if metadata.SESSION_START_INFO_TAG in events.summary_metadata:  # metadata only: no tensor, no Tags() entry
        content = events.SummaryMetadata(metadata.SESSION_START_INFO_TAG).plugin_data.content
        start = metadata.parse_session_start_info_plugin_data(content)
        hparams = {name: getattr(value, value.WhichOneof("kind")) for name, value in start.hparams.items()}
        content = events.SummaryMetadata(metadata.EXPERIMENT_TAG).plugin_data.content
        metrics = [info.name.tag for info in metadata.parse_experiment_plugin_data(content).metric_infos]
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in tags["scalars"]}
    return RunViews(layout, hparams, metrics, scalars)
