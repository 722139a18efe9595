"""The rank inspector: what each rank sends back, and what the notebook shows of it."""

from __future__ import annotations

import base64
import html
import math
import pickle
import re
from xml.etree import ElementTree

import pytest
import torch

from notebook_launcher.errors import LaunchTypeError
from notebook_launcher.value_summaries import (
    GRID_COLS,
    GRID_ROWS,
    check_names,
    summarize,
    summarize_name,
)
from notebook_launcher.widgets.inspector import Inspection, render_html, render_text, verdict
from tests.support.kernel_driver import with_session

SHOWN = ("display_data", "update_display_data", "execute_result")


def stage(name, values):
    return {name: [summarize(v, name, rank) for rank, v in enumerate(values)]}


# What a rank computes ---------------------------------------------------------------------


def test_a_small_tensor_sends_every_element_and_its_stats():
    s = summarize(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "t", 1)
    assert (s.kind, s.shape, s.dtype, s.device, s.numel) == ("tensor", (2, 2), "float32", "cpu", 4)
    assert s.elements == ("1", "2", "3", "4") and s.grid == ((1.0, 2.0), (3.0, 4.0))
    assert (s.minimum, s.maximum, s.mean) == (1.0, 4.0, 2.5)


def test_a_ten_million_element_tensor_becomes_a_summary_of_a_few_kilobytes():
    big = torch.randn(1000, 10_000)
    s = summarize(big, "big")
    assert len(pickle.dumps(s)) < 8_000  # 40 MB of floats stay on the rank
    assert s.numel == 10_000_000 and s.elements == ()
    assert (
        len(s.grid) == GRID_ROWS and len(s.grid[0]) == GRID_COLS and "mean of about" in s.grid_note
    )
    assert s.key == summarize(big.clone()).key != summarize(big + 1).key


def test_nan_inf_bool_int_complex_empty_and_half_tensors_all_summarise():
    s = summarize(torch.tensor([1.0, math.nan, math.inf, -2.0]))
    assert (s.nan, s.inf, s.minimum, s.maximum) == (1, 1, -2.0, 1.0)
    assert summarize(torch.tensor([True, False])).elements == ("True", "False")
    assert summarize(torch.arange(3)).dtype == "int64"
    assert summarize(torch.tensor([1 + 2j])).elements == ("1+2j",)
    assert summarize(torch.zeros(0)).grid == ()
    assert summarize(torch.ones(2, dtype=torch.bfloat16)).dtype == "bfloat16"
    assert summarize(torch.tensor(5.0)).text == "5"
    everything_nan = summarize(torch.full((3,), math.nan))
    assert everything_nan.nan == 3 and everything_nan.minimum is None


def test_numbers_strings_and_objects_travel_as_cut_text():
    assert summarize(3, "n").text == "3" and summarize(3, "n").kind == "number"
    long = summarize("x" * 10_000)
    assert long.kind == "text" and len(long.text) < 400 and "10,000 characters" in long.text
    assert summarize(b"\xff".decode("utf-8", "surrogateescape")).text == "\\udcff"
    assert summarize("\x1b[31mred").text == "\x1b[31mred"
    unpicklable = summarize(iter([1]))
    assert unpicklable.kind == "object" and "iterator" in unpicklable.text


def test_a_name_or_attribute_missing_on_the_rank_is_said_so():
    assert summarize_name({}, "total", 3).text == "total is not defined on rank 3"
    missing = summarize_name({"model": object()}, "model.weight", 1)
    assert not missing.present and missing.text == "model has no attribute weight on rank 1"

    class Broken:
        @property
        def value(self):
            raise RuntimeError("no")

    assert (
        summarize_name({"b": Broken()}, "b.value", 0).text
        == "reading b.value raised RuntimeError on rank 0"
    )


def test_only_variable_names_and_dotted_paths_can_be_shown():
    assert check_names(["a", "model.weight.grad"]) == ("a", "model.weight.grad")
    with pytest.raises(
        LaunchTypeError, match=r"show\(\) takes names of the ranks' variables.*'a<b'"
    ):
        check_names(["a<b"])
    with pytest.raises(LaunchTypeError, match="show"):
        check_names(["__import__('os').system('x')"])


# What the notebook shows --------------------------------------------------------------------


def test_equal_values_are_marked_equal_and_differing_ranks_highlighted():
    same = stage("t", [torch.ones(3)] * 3)
    assert verdict(same["t"]).equal and "equal on every rank (3)" in render_text([("", same)])
    differ = stage("t", [torch.ones(3), torch.ones(3), torch.zeros(3)])
    v = verdict(differ["t"])
    assert not v.equal and v.odd == {2}
    page = render_html([("", differ)])
    assert page.count('data-odd="true"') == 1 and 'data-rank="2" data-odd="true"' in page


def test_mismatched_shapes_and_a_missing_rank_draw():
    values = stage("w", [torch.ones(2, 3), torch.ones(5)])
    values["w"].append(summarize_name({}, "w", 2))
    text = render_text([("", values)])
    assert "differs across ranks" in text and "missing on rank 2" in text
    assert "rank 2: not defined (w is not defined on rank 2)" in text
    page = render_html([("", values)])
    assert page.count('class="nl-picture"') == 2 and "not defined" in page
    assert verdict(values["w"]).odd == {
        2
    }  # every present rank differs: only the missing one stands out


def test_user_text_is_escaped_and_dollars_are_kept_from_mathjax():
    values = stage("s", ['<img src=x onerror="alert(1)"> costs $5 and $6', "<b>"])
    page = render_html([("<script>", values)])
    assert "<img" not in page and "<script>" not in page and "<b>" not in page
    assert html.escape('<img src=x onerror="alert(1)"> costs $5 and $6') in page
    assert page.startswith('<div class="notebook-launcher-inspector tex2jax_ignore mathjax_ignore"')


def test_pictures_are_svg_images_that_survive_html_sanitisers():
    page = render_html([("", stage("m", [torch.randn(3, 4), torch.tensor([1.0, math.nan])]))])
    assert "<svg" not in page  # inline SVG is dropped by sanitisers; images are kept
    pictures = re.findall(r'src="data:image/svg\+xml;base64,([^"]+)"', page)
    assert len(pictures) == 3  # two tensors and the legend of their colour scale
    for picture in pictures:
        root = ElementTree.fromstring(base64.b64decode(picture))
        assert root.tag == "{http://www.w3.org/2000/svg}svg" and len(root) > 0
    assert 'alt="heatmap of m on rank 0"' in page


def test_an_inspection_is_an_ordinary_display_output():
    bundle = Inspection([("", stage("x", [1, 1]))])._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html"}
    assert bundle["text/plain"] == "x: equal on every rank (2)\n  rank 0: int 1\n  rank 1: int 1"


# In a real kernel -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernel():
    yield from with_session()


def shown(cell):
    """The last drawing each display shows (updates replace what a display showed)."""
    by_id: dict[str, dict] = {}
    for message in cell.messages:
        if message["msg_type"] in SHOWN:
            key = (
                message["content"].get("transient", {}).get("display_id")
                or message["header"]["msg_id"]
            )
            by_id[key] = message["content"]["data"]
    return list(by_id.values())


@pytest.mark.kernel
def test_show_draws_tensor_scalar_string_and_a_missing_rank_in_the_kernel(kernel):
    cell = kernel.run("%%distributed --ranks 0\nonly_here = 1")
    assert cell.error is None, cell.error
    cell = kernel.run(
        "%%distributed\n"
        "t = torch.arange(6.).reshape(2, 3) * (rank + 1)\n"
        "x = 3.5\n"
        "label = '<img src=x onerror=alert(1)> $rank$'\n"
        "odd = torch.ones(2 + rank)\n"
    )
    assert cell.error is None, cell.error
    cell = kernel.run("%distributed show t x label odd only_here")
    assert cell.error is None, cell.error
    (data,) = shown(cell)
    text = data["text/plain"]
    assert "t: differs across ranks" in text
    assert "rank 1: Tensor float32 (2, 3) on cpu = [0, 2, 4, 6, 8, 10]" in text
    assert "x: equal on every rank (2)" in text and "rank 0: float 3.5" in text
    assert "label: equal on every rank (2)" in text
    assert "odd: differs across ranks" in text and "(3,)" in text and "(2,)" in text
    assert "only_here: defined on rank 0 only; missing on rank 1" in text
    assert "rank 1: not defined (only_here is not defined on rank 1)" in text
    assert "&lt;img src=x onerror=alert(1)&gt; $rank$" in data["text/html"]
    tags = re.findall(r"<img [^>]*>", data["text/html"])
    # the pictures and the colour scale's legend only
    assert tags and all(
        tag.startswith(('<img class="nl-picture" alt="', '<img class="nl-scale" alt="'))
        for tag in tags
    )


@pytest.mark.kernel
def test_show_around_a_cell_draws_before_and_after_an_all_reduce(kernel):
    assert kernel.run("%%distributed\nv = torch.tensor([1.0, 2.0]) * (rank + 1)").error is None
    cell = kernel.run("%%distributed --show v\ntorch.distributed.all_reduce(v)")
    assert cell.error is None, cell.error
    (data,) = shown(cell)
    assert data["text/plain"].splitlines() == [
        "before the cell: v: differs across ranks (2 different values)",
        "  rank 0: Tensor float32 (2,) on cpu = [1, 2]; min 1, max 2, mean 1.5",
        "  rank 1: Tensor float32 (2,) on cpu = [2, 4]; min 2, max 4, mean 3",
        "after the cell: v: equal on every rank (2)",
        "  rank 0: Tensor float32 (2,) on cpu = [3, 6]; min 3, max 6, mean 4.5",
        "  rank 1: Tensor float32 (2,) on cpu = [3, 6]; min 3, max 6, mean 4.5",
    ]
    assert data["text/html"].count('data-equal="true"') == 1


@pytest.mark.kernel
def test_show_after_a_failing_cell_still_draws_and_the_error_is_raised(kernel):
    assert kernel.run("%%distributed\nw = torch.zeros(2)").error is None
    cell = kernel.run(
        "%%distributed --show w\nw += rank\nif rank == 1:\n    raise ValueError('bad')"
    )
    assert cell.error is not None and "ValueError" in cell.error["ename"]
    (data,) = shown(cell)
    assert "after the cell: w: differs across ranks" in data["text/plain"]


@pytest.mark.kernel
def test_a_ten_million_element_tensor_sends_only_its_summary_through_the_session(kernel):
    assert kernel.run("%%distributed\nbig = torch.randn(10_000_000) + rank").error is None
    cell = kernel.run(
        "import pickle\n"
        "from notebook_launcher.value_summaries import collect\n"
        "session = get_ipython().magics_manager.registry['DistributedMagics'].session\n"
        "summaries = collect(session, ['big'])['big']\n"
        "print('travelled', max(len(pickle.dumps(s)) for s in summaries), [s.numel for s in summaries])\n"
    )
    assert cell.error is None, cell.error
    size = int(cell.stdout.split()[1])
    assert size < 8_000 and "[10000000, 10000000]" in cell.stdout


@pytest.mark.kernel
def test_bad_names_are_refused_with_the_rule(kernel):
    cell = kernel.run("%distributed show 'a<b'")
    assert cell.error is not None and "takes names of the ranks' variables" in cell.error["evalue"]


@pytest.mark.kernel
@pytest.mark.kernel
def test_sixteen_ranks_draw_side_by_side(kernel):
    cell = kernel.run(
        "from notebook_launcher import Session\n"
        "with Session(num_processes=16, hardware='cpu') as wide:\n"
        "    wide.execute(\"v = torch.tensor([float(rank)]); s = 'same'\")\n"
        "    display(wide.show('v', 's'))\n",
        timeout=300,
    )
    assert cell.error is None, cell.error
    (data,) = shown(cell)
    assert "v: differs across ranks (16 different values)" in data["text/plain"]
    assert "s: equal on every rank (16)" in data["text/plain"]
    assert "rank 15: Tensor float32 (1,) on cpu = [15]" in data["text/plain"]
    assert data["text/html"].count('class="nl-card') == 32
    assert 'data-odd="true"' not in data["text/html"]  # every rank its own value: none singled out


def test_unusual_tensors_still_get_a_card():
    import numpy

    meta = summarize_name({"m": torch.empty(3, device="meta")}, "m", 0)
    assert meta.kind == "object" and "could not be summarised: NotImplementedError" in meta.text
    assert summarize(torch.eye(2).to_sparse()).elements == ("1", "0", "0", "1")
    array = summarize(numpy.arange(3.0))
    assert (array.type_name, array.device, array.elements) == ("ndarray", "numpy", ("0", "1", "2"))
    assert summarize(torch.tensor([1, 2], dtype=torch.uint16)).elements == ("1", "2")
    assert summarize(torch.zeros(5, 0)).grid == ()
    assert len(summarize(torch.ones(3, dtype=torch.float8_e4m3fn)).elements) == 3


# Pictures that cannot be read backwards ---------------------------------------------------


def _heatmaps(page: str) -> list[list[str]]:
    """Each heatmap's cell colours, in order (the legend is left out)."""
    found = re.findall(r'alt="heatmap of [^"]*"[^>]*src="data:image/svg\+xml;base64,([^"]+)"', page)
    return [
        re.findall(r'<rect [^>]*fill="(#[0-9a-f]{6})"', base64.b64decode(svg).decode())
        for svg in found
    ]


def _fills(page: str) -> list[str]:
    return [fill for heatmap in _heatmaps(page) for fill in heatmap]


def _darkness(colour: str) -> float:
    r, g, b = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return 255 - (0.299 * r + 0.587 * g + 0.114 * b)


def test_colours_are_centred_on_zero_with_one_scale_across_the_ranks_and_a_legend():
    # All negative: the largest magnitude must be the darkest, on every rank alike.
    values = stage("g", [torch.tensor([[-4.1, -3.6, -2.4]]), torch.tensor([[-3.9, -1.7, -3.5]])])
    page = render_html([("", values)])
    rank0 = _fills(render_html([("", {"g": values["g"][:1]})]))
    assert _darkness(rank0[0]) > _darkness(rank0[1]) > _darkness(rank0[2])  # -4.1, -3.6, -2.4
    both = [_darkness(c) for c in _fills(page)]
    assert both.index(max(both)) == 0  # -4.1 is the darkest of both ranks: one scale
    rank1 = _heatmaps(page)[1]
    assert _darkness(rank1[1]) < _darkness(rank1[0])  # -1.7 lighter than -3.9
    assert page.count('class="nl-legend"') == 1 and "-4.1" in page and "white is 0" in page
    # Blue for negative, red for positive, white at zero.
    mixed = _fills(render_html([("", stage("m", [torch.tensor([[-1.0, 0.0, 1.0]])]))]))
    (r0, _, b0), white, (r2, _, b2) = [
        tuple(int(c[i : i + 2], 16) for i in (1, 3, 5)) for c in mixed
    ]
    assert b0 > r0 and white == (247, 247, 247) and r2 > b2


def _sharded(shape, placement, locals_):
    import dataclasses

    return [
        dataclasses.replace(
            summarize(t, "w", rank),
            type_name="DTensor",
            note=f"local shard of {shape} ({placement})",
        )
        for rank, t in enumerate(locals_)
    ]


def test_a_shard_placement_is_neutral_and_drawn_whole_with_each_owner():
    summaries = _sharded((16, 8), "Shard(dim=0)", [torch.ones(8, 8), torch.zeros(8, 8)])
    v = verdict(summaries)
    assert (v.state, v.words, v.odd, v.equal) == (
        "sharded",
        "sharded: rows 0-7 | 8-15",
        frozenset(),
        False,
    )
    page = render_html([("", {"w": summaries})])
    assert 'data-state="sharded"' in page and "≠" not in page and 'data-odd="true"' not in page
    assert page.count('class="nl-picture nl-ownership"') == 3  # the whole, then each rank's block
    columns = verdict(_sharded((4, 8), "Shard(dim=1)", [torch.ones(4, 4), torch.zeros(4, 4)]))
    assert columns.words == "sharded: columns 0-3 | 4-7"
    uneven = verdict(_sharded((5,), "Shard(dim=0)", [torch.ones(3), torch.zeros(2)]))
    assert uneven.words == "sharded: elements 0-2 | 3-4"
    assert repr(uneven.ownership).splitlines()[1:] == [
        "  rank 0: elements 0-2 (3 of 5 elements)",
        "  rank 1: elements 3-4 (2 of 5 elements)",
    ]
    # One rank shown: no ranges can be said, still not an error.
    alone = verdict(_sharded((16, 8), "Shard(dim=0)", [torch.ones(8, 8), torch.zeros(8, 8)])[1:])
    assert (alone.state, alone.words) == ("sharded", "sharded along dim 0 (Shard(dim=0))")
    same_numbers = verdict(_sharded((4,), "Shard(dim=0)", [torch.ones(2), torch.ones(2)]))
    assert same_numbers.words == "sharded: elements 0-1 | 2-3"  # equal numbers, different parts
    two_d = verdict(
        _sharded((16, 8), "Shard(dim=0), Replicate()", [torch.ones(8, 8), torch.zeros(8, 8)])
    )
    assert (two_d.state, two_d.words) == (
        "sharded",
        "sharded (Shard(dim=0), Replicate()) across the ranks",
    )
    replicated = verdict(_sharded((4,), "Replicate()", [torch.ones(4), torch.zeros(4)]))
    assert replicated.state == "differs"  # replicas that differ are an error


def test_badges_never_contradict_themselves():
    one = [summarize_name({}, "s", 0), summarize(42, "s", 1)]
    v = verdict(one)
    assert (v.state, v.words, v.odd) == (
        "missing",
        "defined on rank 1 only; missing on rank 0",
        frozenset({0}),
    )
    page = render_html([("", {"s": one})])
    assert "≠" not in page and "∅ defined on rank 1 only" in page
    three = [summarize(1, "s", 0), summarize(1, "s", 1), summarize_name({}, "s", 2)]
    assert verdict(three).words == "missing on rank 2; equal on the other 2"
    nowhere = [summarize_name({}, "s", 0), summarize_name({}, "s", 1)]
    assert verdict(nowhere).state == "missing" and "≠" not in render_html([("", {"s": nowhere})])


def test_ownership_and_the_course_charts_carry_their_numbers_in_text():
    from notebook_launcher.widgets.charts import Measured, StackedBars, Timeline
    from notebook_launcher.widgets.ownership import Ownership

    owned = Ownership.from_indices("data", 11, [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 0]])
    assert repr(owned).splitlines() == [
        "data (11,): owned by rank; 1 held by several ranks",
        "  rank 0: elements 0, 2, 4, 6, 8, 10 (6 of 11 elements)",
        "  rank 1: elements 0-1, 3, 5, 7, 9 (6 of 11 elements)",
    ]
    assert (
        "several ranks (*)" in owned._repr_html_()
        and owned._repr_html_().count("nl-ownership") == 3
    )
    with pytest.raises(ValueError, match=r"x: 3 owners given for shape \(2, 2\) \(4 elements\)"):
        Ownership("x", (2, 2), [frozenset({0})] * 3, [0])
    bars = StackedBars(
        "memory",
        {"DDP": {"parameters": 4, "gradients": 4}, "ZeRO-3": {"parameters": 2, "gradients": 2}},
    )
    assert (
        bars.text()
        == "memory:\n  DDP: 8 bytes (parameters 4, gradients 4)\n  ZeRO-3: 4 bytes (parameters 2, gradients 2)"
    )
    timeline = Timeline(
        "pipe",
        [
            ("rank 0", "F1", 0.0, 1.0),
            ("rank 1", "F1", 1.0, 2.0),
            ("rank 1", "B1", 2.0, 3.0),
            ("rank 0", "B1", 3.0, 4.0),
        ],
    )
    assert timeline.idle_fraction("rank 0") == 0.5 and "rank 1: F1 B1; idle 50%" in timeline.text()
    assert timeline.order("rank 1") == ["F1", "B1"] and timeline.gaps("rank 0") == [
        ("F1", "B1", 2.0)
    ]
    measured = Measured(
        "t", {"all_reduce": [(1000, 0.5), (2000, 1.0)]}, {"all_reduce": (0.0, 0.0005)}
    )
    assert "bytes 2,000: seconds 1, model 1" in measured.text()
    assert "all_reduce: model alpha 0 s + beta 0.0005 s/byte" in measured.text()
    for shown in (owned, bars, timeline, measured):
        page = shown._repr_mimebundle_()["text/html"]
        assert (
            "<svg" not in page and len(re.findall(r'src="data:image/svg\+xml;base64,', page)) >= 1
        )


def _svg_of(page: str, alt_start: str) -> str:
    found = re.findall(r'alt="([^"]*)"[^>]*src="data:image/svg\+xml;base64,([^"]+)"', page)
    return next(base64.b64decode(b).decode() for alt, b in found if alt.startswith(alt_start))


def test_heatmap_labels_are_rounded_to_three_figures_and_keep_their_magnitude():
    from notebook_launcher.widgets.inspector import label

    assert [label(x) for x in (-2.179, 12345, 0.0004, 0.0123, 999.7, 1.0, 0.0, -0.5)] == [
        "-2.18",
        "1.23e4",
        "4e-4",
        "0.0123",
        "1e3",
        "1",
        "0",
        "-0.5",
    ]
    page = render_html([("", stage("m", [torch.tensor([[-2.179, 12345.0], [0.0004, 1.0]])]))])
    svg = _svg_of(page, "heatmap of m")
    assert re.findall(r">([^<>]+)</text>", svg) == ["-2.18", "1.23e4", "4e-4", "1"]
    # The cells widen to hold the widest number: no label is wider than its cell.
    width = float(re.search(r'<rect x="0" y="0" width="([\d.]+)"', svg)[1])
    assert width >= len("1.23e4") * 5.4


def test_rank_colours_share_nothing_with_the_value_colours():
    from notebook_launcher.widgets import inspector
    from notebook_launcher.widgets.ownership import RANK_COLOURS

    def rgb(colour):
        return tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))

    values = [rgb(inspector._colour(x / 50, (-1.0, 1.0))) for x in range(-50, 51)]
    values += [rgb(inspector.NAN_COLOUR), rgb(inspector.INF_COLOUR)]
    for colour in RANK_COLOURS:
        nearest = min(math.dist(rgb(colour), v) for v in values)
        assert nearest > 60, (colour, nearest)  # never read as a value, nor a value as a rank
    assert len(set(RANK_COLOURS)) == len(RANK_COLOURS)


def test_a_difference_the_caller_intends_gets_a_neutral_badge():
    values = stage("mine", [torch.tensor([10.0, 12.0]), torch.tensor([14.0, 16.0])])
    assert verdict(values["mine"]).state == "differs"
    v = verdict(values["mine"], per_rank=True)
    assert (v.state, v.words, v.odd) == (
        "per-rank",
        "per rank, by design (2 different values)",
        frozenset(),
    )
    shown = Inspection([("", values)], per_rank=["mine"])
    page = shown._repr_html_()
    assert 'data-state="per-rank"' in page and "≠" not in page and "#d62728" not in page
    assert repr(shown).splitlines()[0] == "mine: per rank, by design (2 different values)"
    # Equal values are still said to be equal; a missing rank is still said to be missing.
    same = stage("s", [torch.ones(2), torch.ones(2)])["s"]
    assert verdict(same, per_rank=True).state == "equal"
    lacking = [summarize(1, "x", 0), summarize_name({}, "x", 1)]
    assert verdict(lacking, per_rank=True).state == "missing"


def test_a_rank_s_part_is_drawn_at_the_whole_s_cell_size():
    summaries = _sharded((16, 8), "Shard(dim=0)", [torch.randn(8, 8), torch.randn(8, 8)])
    page = render_html([("", {"w": summaries})])
    sizes = dict(
        (alt, (int(w), int(h)))
        for alt, w, h in re.findall(r'alt="([^"]*)" width="(\d+)" height="(\d+)"', page)
    )
    whole = sizes["ownership of w"]
    part = sizes["heatmap of w on rank 0"]
    assert whole[1] == 2 * part[1] and whole[0] == part[0]  # 16 rows against 8, the same columns


def test_zero_bars_are_visible_and_numbers_never_wrap_inside():
    page = render_html([("", stage("v", [torch.tensor([0.0, 1.0, -1.0, 0.0])]))])
    svg = _svg_of(page, "bar chart of v")
    heights = [float(h) for h in re.findall(r'<rect [^>]*height="([\d.]+)"', svg)]
    assert len(heights) == 4 and min(heights) >= 3
    lists = render_html([("", stage("l", [list(range(100))]))])
    assert "break-all" not in page + lists and "overflow-wrap: break-word" in page + lists


def test_every_block_of_a_timeline_is_labelled_and_the_axis_has_times():
    from notebook_launcher.widgets.charts import Timeline

    spans = [("rank 0", f"F{i}", i * 0.001, i * 0.001 + 0.0005) for i in range(1, 9)]
    spans += [("rank 0", "B1", 0.01, 0.5), ("rank 1", "F1", 0.002, 0.003)]
    page = Timeline("t", spans)._repr_html_()
    svg = base64.b64decode(re.search(r'base64,([^"]+)"', page)[1]).decode()
    labels = re.findall(r">([FB]\d)</text>", svg)
    assert sorted(labels) == sorted(label for _, label, _, _ in spans)  # narrow ones too
    assert "time since the first span (ms)" in svg and ">400</text>" in svg
