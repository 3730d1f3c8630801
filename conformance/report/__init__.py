"""Reports: JSON, Markdown, JUnit, HTML; baseline compare; repro scripts."""
