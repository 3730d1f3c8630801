"""Print how often the strategies draw each case feature (conformance.run.features)
in a report: the README's table. Usage: python ci/features.py REPORT.json"""

import json
import sys

from conformance.report.markdown import features_table

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python ci/features.py REPORT.json")
    sys.stdout.write(features_table(json.load(open(sys.argv[1]))))
