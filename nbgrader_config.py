"""nbgrader configuration found by JupyterLab's formgrader when `make lab` starts at the
repository root: the course's settings from grading/nbgrader_config.py, with the course
root that `python -m grading.grade --prepare-only` builds (labs converted and released)."""

c = get_config()  # noqa: F821  (provided by traitlets)
load_subconfig("grading/nbgrader_config.py")  # noqa: F821
c.CourseDirectory.root = "build/nbgrader"
