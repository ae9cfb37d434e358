"""Migration scripts, one per schema revision, applied in order by :func:`service.db.schema.upgrade`.

They may import Alembic and SQLAlchemy only.
"""
