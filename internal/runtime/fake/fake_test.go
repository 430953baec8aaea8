package fake

import (
	"context"
	"os"
	"testing"
	"time"

	goruntime "runtime"

	"github.com/spacedev/space/internal/runtime"
)

// busyEnv makes the test binary stand in for the agent: a Go process whose threads
// are busy, so that pausing it is a group stop of threads running on other CPUs.
const busyEnv = "SPACE_FAKE_TEST_BUSY"

func TestMain(m *testing.M) {
	if os.Getenv(busyEnv) != "" {
		for range 3 {
			go func() {
				for {
					goruntime.Gosched()
				}
			}()
		}
		time.Sleep(time.Minute) // the test destroys it long before
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestPauseResumeAreDone: Status agrees with a Pause or Resume as soon as it returns,
// as with the real runtimes. A stop signal lands a moment after kill(2) returns (a
// multi-threaded process almost never reads as stopped at once), and a resume asked
// for right after a pause found the sandbox still running.
func TestPauseResumeAreDone(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	r, err := New(Config{Dir: t.TempDir(), AgentPath: exe})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := r.Create(ctx, runtime.Spec{ID: "a", AgentEnv: map[string]string{busyEnv: "1"}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Destroy(context.Background(), "a") })
	for i := range 100 {
		if err := r.Pause(ctx, "a"); err != nil {
			t.Fatal(err)
		}
		if st, err := r.Status(ctx, "a"); err != nil || st != runtime.StatusPaused {
			t.Fatalf("round %d: Status after Pause = %s, %v", i, st, err)
		}
		if err := r.Resume(ctx, "a"); err != nil {
			t.Fatal(err)
		}
		if st, err := r.Status(ctx, "a"); err != nil || st != runtime.StatusRunning {
			t.Fatalf("round %d: Status after Resume = %s, %v", i, st, err)
		}
	}
}
