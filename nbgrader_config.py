"""nbgrader configuration found by JupyterLab when `make lab` starts at the repository
root: the course's settings from grading/nbgrader_config.py, the course root that
`python -m grading.grade --prepare-only` builds (labs generated and released), and a local
exchange beside it (build/exchange), so that on one machine the Formgrader (instructor) and the
Assignment List (learner: fetch, validate, submit) both work. Fetched labs land in
build/labs/<lab>/."""

from pathlib import Path

c = get_config()  # noqa: F821  (provided by traitlets)
load_subconfig("grading/nbgrader_config.py")  # noqa: F821
_here = Path(__file__).resolve().parent
c.CourseDirectory.root = str(_here / "build" / "nbgrader")
c.Exchange.root = str(_here / "build" / "exchange")
c.Exchange.assignment_dir = str(_here / "build" / "labs")
