"""Scripts: a cast and many lines rendered as takes of a directing session (docs/scripts.md).

``format`` parses the two script forms (sans-I/O), ``timeline`` places lines (and their captions) in the mix to
the sample, ``words`` gets each line's word timing, ``store`` keeps render jobs in the session database,
``fairness`` shares the engine between clients' renders, ``events`` numbers a job's server-sent events, ``render``
makes one line a take, ``service`` runs the jobs, ``export`` streams the zip, ``client`` is ``moss-rt render``.
"""
