package fcfake

import (
	"encoding/json"
	"fmt"
	"os"
	"time"
)

// vmstateFormat marks the fake's snapshot state files.
const vmstateFormat = "fcfake-vmstate-1"

// vmstate is what the fake writes as a snapshot's state file: the device configuration
// a real vmstate carries, including the host resource names Firecracker bakes in (drive
// paths, TAP names, the vsock socket path).
type vmstate struct {
	Format    string              `json:"format"`
	Version   string              `json:"firecracker_version"`
	Boot      *bootSource         `json:"boot_source"`
	Drives    []*drive            `json:"drives"`
	Ifaces    []*networkInterface `json:"network_interfaces"`
	Machine   machineConfig       `json:"machine_config"`
	Vsock     *vsockDevice        `json:"vsock,omitempty"`
	GuestPort uint32              `json:"guest_port"`
}

func (s *Server) createSnapshot(body []byte) response {
	var c snapshotCreate
	if err := s.decode(body, &c); err != nil {
		return fault("%v", err)
	}
	switch {
	case c.SnapshotPath == nil:
		return fault("%s", deserializeMsg("missing field `snapshot_path`"))
	case c.MemFilePath == nil:
		return fault("%s", deserializeMsg("missing field `mem_file_path`"))
	case c.SnapshotType != nil && !oneOf(*c.SnapshotType, "Full", "Diff"):
		return fault("%s", deserializeMsg(fmt.Sprintf("unknown variant `%s`, expected `Full` or `Diff`", *c.SnapshotType)))
	case s.state == StateNotStarted:
		return fault(msgBeforeStart)
	case s.state != StatePaused:
		return fault("Create snapshot error: Cannot save the microVM state: the microVM is not paused (state %s).", s.state)
	}
	// Taking the snapshot resets the guest's vsock transport: every connection dies.
	s.resetConnsLocked()
	st := vmstate{
		Format: vmstateFormat, Version: s.version.String(), Boot: s.boot, Drives: s.drives,
		Ifaces: s.ifaces, Machine: s.machine, Vsock: s.vsock, GuestPort: s.guestPort,
	}
	data, err := json.Marshal(st)
	if err != nil {
		return fault("Create snapshot error: %v", err)
	}
	if err := s.writeFile(*c.SnapshotPath, data, 0); err != nil {
		return fault("Create snapshot error: Cannot save the microVM state: %v", err)
	}
	if err := s.writeFile(*c.MemFilePath, nil, int64(*s.machine.MemSizeMib)<<20); err != nil {
		return fault("Create snapshot error: Cannot save the guest memory: %v", err)
	}
	return noContent
}

// writeFile creates or truncates p (a request path) with data, or sparse at size.
func (s *Server) writeFile(p string, data []byte, size int64) error {
	hp := s.hostPath(p)
	if _, err := os.Lstat(hp); err != nil {
		if err := s.checkCreate(hp); err != nil {
			return err
		}
	} else if err := s.openable(p, true); err != nil {
		return err
	}
	f, err := os.OpenFile(hp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	s.own(hp)
	if data != nil {
		if _, err := f.Write(data); err != nil {
			f.Close()
			return err
		}
	} else if err := f.Truncate(size); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func (s *Server) loadSnapshot(body []byte) response {
	var l snapshotLoad
	if err := s.decode(body, &l); err != nil {
		return fault("%v", err)
	}
	switch {
	case l.SnapshotPath == nil:
		return fault("%s", deserializeMsg("missing field `snapshot_path`"))
	case l.MemBackend != nil && l.MemFilePath != nil:
		return fault("%s", deserializeMsg("too many fields: either `mem_backend` or `mem_file_path` exclusively is required"))
	case l.MemBackend == nil && l.MemFilePath == nil:
		return fault("%s", deserializeMsg("missing field: either `mem_backend` or `mem_file_path` is required"))
	case l.MemBackend != nil && l.MemBackend.BackendType == nil:
		return fault("%s", deserializeMsg("missing field `backend_type`"))
	case l.MemBackend != nil && l.MemBackend.BackendPath == nil:
		return fault("%s", deserializeMsg("missing field `backend_path`"))
	case l.MemBackend != nil && !oneOf(*l.MemBackend.BackendType, "File", "Uffd"):
		return fault("%s", deserializeMsg(fmt.Sprintf("unknown variant `%s`, expected `File` or `Uffd`", *l.MemBackend.BackendType)))
	case s.state != StateNotStarted:
		return fault(msgAfterStart)
	case s.bootConfig:
		return fault(msgLoadAfter)
	}
	// From here on a failure ends the process, as in Firecracker.
	r := s.load(l)
	if r.fault != "" {
		s.loadFailed = true
	}
	return r
}

func (s *Server) load(l snapshotLoad) response {
	data, err := os.ReadFile(s.hostPath(*l.SnapshotPath))
	if err == nil && s.opts.CheckAccess {
		err = s.access(s.hostPath(*l.SnapshotPath), 4)
	}
	if err != nil {
		return fault("Load snapshot error: Failed to restore from snapshot: Failed to get snapshot state from file: %v", err)
	}
	var st vmstate
	if err := json.Unmarshal(data, &st); err != nil || st.Format != vmstateFormat {
		return fault("Load snapshot error: Failed to restore from snapshot: Failed to load snapshot state from file: invalid snapshot state")
	}
	sv, err := parseVersion(st.Version)
	if err != nil || sv.major != s.version.major || sv.minor != s.version.minor {
		return fault("Load snapshot error: Failed to restore from snapshot: Failed to load snapshot state from file: unsupported snapshot version (made by Firecracker %s, this is %s)", st.Version, s.version)
	}
	if l.MemBackend != nil && *l.MemBackend.BackendType == "Uffd" {
		return fault("Load snapshot error: Failed to restore from snapshot: the fake does not serve Uffd memory backends")
	}
	memPath := ""
	if l.MemBackend != nil {
		memPath = *l.MemBackend.BackendPath
	} else {
		memPath = *l.MemFilePath
	}
	fi, err := os.Stat(s.hostPath(memPath))
	if err == nil && s.opts.CheckAccess {
		err = s.access(s.hostPath(memPath), 4)
	}
	if err != nil {
		return fault("Load snapshot error: Failed to restore from snapshot: Failed to load guest memory: %v", err)
	}
	if want := int64(*st.Machine.MemSizeMib) << 20; fi.Size() != want {
		return fault("Load snapshot error: Failed to restore from snapshot: Failed to load guest memory: file is %d bytes, the snapshot has %d", fi.Size(), want)
	}
	for _, d := range st.Drives {
		if d.PathOnHost == nil {
			continue
		}
		rw := d.IsReadOnly == nil || !*d.IsReadOnly
		if err := s.openable(*d.PathOnHost, rw); err != nil {
			return fault("Load snapshot error: Failed to restore from snapshot: Failed to build microVM from snapshot: Block(BackingFile(%v, %q))", err, *d.PathOnHost)
		}
	}
	if l.NetworkOverrides != nil {
		for _, o := range *l.NetworkOverrides {
			if o.IfaceID == nil || o.HostDevName == nil {
				return fault("%s", deserializeMsg("missing field `iface_id` or `host_dev_name`"))
			}
			found := false
			for _, n := range st.Ifaces {
				if *n.IfaceID == *o.IfaceID {
					n.HostDevName = o.HostDevName
					found = true
				}
			}
			if !found {
				return fault("Load snapshot error: Failed to restore from snapshot: network override for unknown interface %s", *o.IfaceID)
			}
		}
	}
	if st.Vsock != nil {
		uds := *st.Vsock.UDSPath
		if l.VsockOverride != nil {
			if l.VsockOverride.UDSPath == nil {
				return fault("%s", deserializeMsg("missing field `uds_path`"))
			}
			uds = *l.VsockOverride.UDSPath
			st.Vsock.UDSPath = &uds
		}
		if err := s.bindVsockLocked(uds); err != nil {
			return fault("Load snapshot error: Failed to restore from snapshot: Failed to build microVM from snapshot: VsockUnixBackend(UnixBind(%v))", err)
		}
	} else if l.VsockOverride != nil {
		return fault("Load snapshot error: Failed to restore from snapshot: vsock_override given but the snapshot has no vsock device")
	}
	s.boot, s.drives, s.ifaces, s.machine, s.vsock = st.Boot, st.Drives, st.Ifaces, st.Machine, st.Vsock
	s.guestPort = st.GuestPort
	s.guestAt = time.Now() // the guest was running when it was saved
	if l.ResumeVM != nil && *l.ResumeVM {
		s.setStateLocked(StateRunning)
	} else {
		s.setStateLocked(StatePaused)
	}
	return noContent
}
