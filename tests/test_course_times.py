"""grading/course_times.report: the CI projection, on made-up numbers worked by hand."""

from grading import course_times as ct


def _data(ci_chapters=None, ci_labs=None, rc=0):
    inside = {"chapter": {f"ch{i:02d}": 60.0 for i in range(7)},
              "lab": {f"ch{i:02d}": 80.0 for i in range(7)}}
    data = {"suite": {"kind": "suite", "seconds": 1000.0, "workers": 2, "inside": inside},
            "ci_run": {"kind": "ci_run", "seconds": 1760.0, "pytest_s": 1600.0}}
    if ci_chapters:
        data["ci_run"]["chapters"] = ci_chapters
    if ci_labs:
        data["ci_run"]["labs"] = ci_labs
    data["ci_run"]["returncode"] = rc
    return data


def test_projection_from_item_means():
    # 160 s outside pytest + 1000 s + 23 x 60 / 2 + 23 x 80 / 2 = 2770 s
    _, summary = ct.report(_data())
    assert summary["projected_ci_s"] == 2770
    assert "projected_ci_by_growth_s" not in summary


def test_projection_takes_the_growth_between_two_full_runs_when_larger():
    # growth (1600 - 1000) / (13 - 7) = 100 s per chapter with its lab;
    # 160 + 1600 + 17 x 100 = 3460 s, larger than the item means' 2770 s
    text, summary = ct.report(_data(ci_chapters=13))
    assert summary["growth_per_chapter_and_lab_s"] == 100.0
    assert summary["projected_ci_by_growth_s"] == 3460
    assert summary["projected_ci_s"] == 3460
    assert "OVER" not in text.split("CI projected", 1)[1].splitlines()[0]  # 57.7 min < 60


def test_a_passing_full_course_run_is_the_measurement_not_a_projection():
    # 30 chapters and 30 labs ran end to end in 1760 s: that is CI's time, 29.3 min
    text, summary = ct.report(_data(ci_chapters=30, ci_labs=30))
    assert summary["projected_ci_s"] == 1760 and summary["ci_measured_full_course"]
    assert "measured, not projected" in text and "29.3 min" in text
    assert "projected_ci_by_growth_s" not in summary
    # a failed run, or one with fewer labs, is not taken as the measurement
    for data in (_data(ci_chapters=30, ci_labs=30, rc=1), _data(ci_chapters=30, ci_labs=29)):
        _, summary = ct.report(data)
        assert "ci_measured_full_course" not in summary
