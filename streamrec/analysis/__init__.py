"""Offline analysis of what serving logged: ``grading`` joins logged predictions to the labels
that came later and grades them; ``grading_input`` reads both topics for it. Used by
``streamrec experiments report`` and the demo's experiment."""
