"""Offline batch inference as a Ray job: ``python -m nvray.batch --input IN --output OUT``
(``__main__``: arguments, the plan checked before Ray starts, the run and its summary). Every
input row (JSON Lines or Parquet, with an ``id`` and a ``prompt`` or chat ``messages``) yields
exactly one output row, in input order; a bad input ends the run with exit status 2 before
anything starts on Ray, and the output file appears only when the whole job succeeded.
``io`` validates, reads and writes the row files (pyarrow only), ``read`` turns a validated input
into a Ray Data dataset, and ``udf`` is the Ray Data actor class that owns one whole nvray engine.
Importing the package imports nothing else (no pyarrow, Ray or torch).
"""
