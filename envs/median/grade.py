# Run the tests, write the reward (the seed's grader).
import json, subprocess, sys, time
t = time.time()
r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--tb=no", "-p", "no:cacheprovider", "task"],
                   capture_output=True, text=True)
last = r.stdout.strip().splitlines()[-1]          # e.g. "1 failed, 3 passed in 0.02s"
passed = int(last.split(" passed")[0].split()[-1]) if " passed" in last else 0
failed = int(last.split(" failed")[0].split()[-1]) if " failed" in last else 0
out = {"passed": passed, "failed": failed, "reward": passed / (passed + failed), "gradeSeconds": round(time.time() - t, 2)}
json.dump(out, open("/home/user/result.json", "w"))
print(json.dumps(out))
