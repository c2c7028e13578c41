"""nbgrader configuration for the course's labs (copied into the build course root by
``python -m grading.grade``; usable as is with ``--CourseDirectory.root``)."""

c = get_config()  # noqa: F821  (provided by traitlets when nbgrader loads this file)

c.CourseDirectory.course_id = "minivllm-precision"
c.CourseDirectory.source_directory = "source"
c.CourseDirectory.release_directory = "release"
c.CourseDirectory.submitted_directory = "submitted"
c.CourseDirectory.autograded_directory = "autograded"
c.CourseDirectory.feedback_directory = "feedback"

# Set on purpose. A cell that runs longer (an infinite loop) is interrupted, scores zero,
# and grading continues with the next cell. A correct solution must get full marks on a
# busy grader too: python -m grading.grade flags every solution cell slower than a quarter
# of this (30 s, a lab's whole solution budget on an idle 2-core machine), so a lab that
# keeps its cells under that has 4x headroom. Measured with two CPU-burning processes
# beside the kernel (`--load 2`) on top of other people's jobs (load average 6-10): the
# slowest solution cells took 46 s (ch02) and over 60 s (ch01, interrupted at the former
# 60 s limit). The infinite-loop fixture costs this much per lab it runs for.
c.Execute.timeout = 120
c.Execute.interrupt_on_timeout = True
# After a cell's reply, nbclient waits for the rest of its output (until the kernel says
# idle) at most this long between messages; nbgrader raises on that timeout
# (raise_on_iopub_timeout), which fails the whole submission ("error processing
# assignment"). nbclient's default of 4 s did that to lab 2's solution on this 2-core
# machine at load average 12-19 (2026-12-01). Waiting longer costs nothing when output
# comes on time.
c.Execute.iopub_timeout = 60

# What a learner sees in place of a solution.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"

# The class (the Formgrader and the commands of docs/instructor.md).
# `nbgrader collect` takes a learner's newer submission in place of the one collected
# (nbgrader's default skips it, saying only "use --update"); autograde then grades it.
c.ExchangeCollect.update = True
# Late policy: a lab's due date is set in the gradebook (`nbgrader db assignment add ch01
# --duedate="2026-03-02 23:59:00 Europe/Berlin"`, or `nbgrader db assignment import
# duedates.csv`, or the Formgrader's Manage Assignments); a submission after it loses
# percent_per_day % of its score per started day late (grading/classroom.py). 0: late
# submissions are flagged in the gradebook, not penalised; nbgrader's
# c.LatePenalty.penalty_method = "zero" gives zero for any late submission.
c.AssignLatePenalties.plugin_class = "grading.classroom.LatePenalty"
c.LatePenalty.percent_per_day = 10.0
# `nbgrader export`: one row per learner, one column per lab (an LMS's grade import), in
# <course root>/grades.csv wherever it runs (--to FILE elsewhere).
c.ExportApp.plugin_class = "grading.classroom.LmsCsvExport"
