"""nbgrader configuration for the course's labs (copied into the build course root by
``python -m grading.grade``; usable as is with ``--CourseDirectory.root``)."""

c = get_config()  # noqa: F821  (provided by traitlets when nbgrader loads this file)

c.CourseDirectory.course_id = "minivllm-precision"
c.CourseDirectory.source_directory = "source"
c.CourseDirectory.release_directory = "release"
c.CourseDirectory.submitted_directory = "submitted"
c.CourseDirectory.autograded_directory = "autograded"
c.CourseDirectory.feedback_directory = "feedback"

# Set on purpose: each lab cell must finish well within this on a 2-core CPU (labs are
# designed for < 60 s in total). A cell that runs longer (an infinite loop) is interrupted,
# scores zero, and grading continues with the next cell.
c.Execute.timeout = 60
c.Execute.interrupt_on_timeout = True

# What a learner sees in place of a solution.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"
