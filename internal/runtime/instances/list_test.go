package instances

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/spacedev/space/internal/runtime"
)

func TestList(t *testing.T) {
	status := func(_ context.Context, id string) (runtime.Status, error) {
		switch id {
		case "gone":
			return "", fmt.Errorf("status: %w", runtime.ErrNotFound)
		case "broken":
			return "", errors.New("boom")
		}
		return runtime.StatusRunning, nil
	}
	got, err := List(context.Background(), []string{"b", "gone", "a", "b"}, status)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].ID != "a" || got[1].ID != "b" || got[0].Status != runtime.StatusRunning {
		t.Fatalf("List = %+v, want a and b running, sorted, once each", got)
	}
	if _, err := List(context.Background(), []string{"a", "broken"}, status); err == nil {
		t.Fatal("List swallowed a status error")
	}
}
