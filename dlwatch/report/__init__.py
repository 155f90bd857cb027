"""Incident reports and run summaries: the store on disk, the builder, the renderers.

``store`` (atomic, private directories; loading with checks), ``build`` (one incident from what
the monitor or attach found), ``render``/``display`` (Markdown and terminal), ``summary`` (run
summaries), ``html`` (report.html, drawn in a child), ``jobview`` and ``rankfigures`` (the job
view over ranks), ``trim``.

May import: the shared helpers, ``wire``, ``collect``, ``detect``.
"""
