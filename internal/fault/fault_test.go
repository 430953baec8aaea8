package fault_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/spacedev/space/internal/fault"
)

// A Redacted error keeps its cause for the log (Error) and tells clients only its
// message (Message), also when other errors wrap it; other errors are told whole.
func TestMessage(t *testing.T) {
	cause := errors.New("failed to connect to `user=space database=space`: dial unix /data/postgres/run/.s.PGSQL.5432: connect: connection refused")
	err := fmt.Errorf("load sandbox: %w", fault.Redacted(fault.Unavailable, "database unavailable", cause))
	if got := fault.Message(err); got != "database unavailable" {
		t.Errorf("client message: %q", got)
	}
	if !strings.Contains(err.Error(), ".s.PGSQL.5432") || !errors.Is(err, cause) {
		t.Errorf("the log's message lost the cause: %q", err)
	}
	if fault.KindOf(err) != fault.Unavailable {
		t.Errorf("kind: %v", fault.KindOf(err))
	}
	for _, e := range []error{
		fault.New(fault.Conflict, "sandbox x is starting"),
		fmt.Errorf("create: %w", fault.Wrap(fault.Invalid, errors.New("bad name"))),
		errors.New("plain"),
	} {
		if got := fault.Message(e); got != e.Error() {
			t.Errorf("Message(%q) = %q", e, got)
		}
	}
}
