from tests.db.databases import db_url, pg_database, pg_server  # noqa: F401 - fixtures
