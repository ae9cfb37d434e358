"""Alembic migrations of the metadata database, installed as ``service.migrations``.

The files live at the top of the repository (``migrations/``) and setuptools maps them into the
``service`` package, so a non-editable install carries them. :mod:`service.db.schema` builds the
Alembic configuration in code; there is no ``alembic.ini``.

It may import Alembic, SQLAlchemy and, of the engine, only :mod:`service.settings` (``env.py``
reads the database URL); never the models, the store or its job modules: a script describes its
own tables, as they were at its revision.
"""
