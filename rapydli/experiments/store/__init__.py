"""The run store: SQLite records of runs, their files, annotations, provenance and recorded sources, and merging stores."""
