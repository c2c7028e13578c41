"""The class on one machine (`make lab`): the nbgrader configuration JupyterLab reads when
`make lab` starts it at the repository root, and the one `python -m grading.grade
--prepare-only` (run by `make lab`) takes its paths from.

- the course's settings: grading/nbgrader_config.py (course id, timeout, the late policy,
  the grade export, collect taking resubmissions);
- the course root build/nbgrader (gradebook.db, source/, release/, submitted/,
  autograded/, feedback/, grades.csv): prepare keeps the gradebook and every submission;
- the exchange build/exchange (released labs, submissions, returned feedback);
- the learner's folder build/labs (fetched labs, with their feedback), and nbgrader's
  record of the learner's submissions, build/nbgrader_cache (nbgrader's default is one
  folder per user account, ~/.local/share/jupyter/nbgrader_cache, which every checkout
  and every test of this course would share: the Assignment List then shows submissions
  made to other exchanges).

Prepare writes build/nbgrader/nbgrader_config.py and build/labs/nbgrader_config.py with
the same settings (nbgrader reads the configuration of the folder it runs in: the
instructor's `cd build/nbgrader && nbgrader collect ch01`, and the Assignment List, which
reads it again inside build/labs). Change the paths here, then run prepare (`make lab`).
Every path is absolute, so nbgrader finds them from any folder."""

from pathlib import Path

c = get_config()  # noqa: F821  (provided by traitlets)
_here = Path(__file__).resolve().parent
# absolute: a relative load_subconfig resolves against the first file nbgrader read (not
# this one) when this file is itself loaded from another folder's configuration
load_subconfig(str(_here / "grading" / "nbgrader_config.py"))  # noqa: F821
c.CourseDirectory.root = str(_here / "build" / "nbgrader")
c.Exchange.root = str(_here / "build" / "exchange")
c.Exchange.assignment_dir = str(_here / "build" / "labs")
c.Exchange.cache = str(_here / "build" / "nbgrader_cache")
