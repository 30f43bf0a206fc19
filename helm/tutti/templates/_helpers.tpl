{{/* Names */}}
{{- define "tutti.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tutti.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* A component's name: fullname-<component>, at most 63 characters. */}}
{{- define "tutti.component" -}}
{{- printf "%s-%s" (include "tutti.fullname" .root | trunc (int (sub 62 (len .name))) | trimSuffix "-") .name }}
{{- end }}

{{- define "tutti.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "tutti.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tutti
{{- end }}

{{/* Selector labels of one component: call with (dict "root" $ "name" "node"). */}}
{{- define "tutti.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tutti.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .name }}
{{- end }}

{{- define "tutti.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "tutti.adminSecretName" -}}
{{- if .Values.admin.existingSecret }}
{{- .Values.admin.existingSecret }}
{{- else }}
{{- include "tutti.component" (dict "root" . "name" "admin-token") }}
{{- end }}
{{- end }}

{{/* etcd endpoints: config.etcd (an external etcd) or the chart's etcd Service; empty: single node. */}}
{{- define "tutti.etcdEndpoints" -}}
{{- if .Values.config.etcd }}
{{- join "," .Values.config.etcd }}
{{- else if .Values.etcd.enabled }}
{{- printf "%s.%s.svc:2379" (include "tutti.component" (dict "root" . "name" "etcd")) .Release.Namespace }}
{{- end }}
{{- end }}

{{- define "tutti.mooncakeMaster" -}}
{{- if .Values.config.mooncake_master }}
{{- .Values.config.mooncake_master }}
{{- else if .Values.mooncake.enabled }}
{{- printf "%s.%s.svc:%d" (include "tutti.component" (dict "root" . "name" "mooncake-master")) .Release.Namespace (int .Values.mooncake.rpcPort) }}
{{- end }}
{{- end }}

{{/* One value as text: whole numbers without an exponent (YAML numbers reach templates as floats). */}}
{{- define "tutti.scalar" -}}
{{- if and (kindIs "float64" .) (eq (floor .) .) }}
{{- printf "%.0f" . }}
{{- else }}
{{- toString . }}
{{- end }}
{{- end }}

{{/*
The TUTTI_* environment of every Tutti process (store nodes, admin, engines): one variable per key
of .Values.config, TUTTI_<KEY>, lists joined with commas, null keys left out (the field's default).
etcd and mooncake_master fall back to the chart's own services; node_id falls back to the
Kubernetes node name.
*/}}
{{- define "tutti.configEnv" -}}
{{- $c := .Values.config }}
{{- range $key := keys $c | sortAlpha }}
{{- $v := get $c $key }}
{{- if and (ne $key "etcd") (ne $key "mooncake_master") (ne $key "node_id") (not (kindIs "invalid" $v)) }}
{{- if kindIs "slice" $v }}
{{- if $v }}
{{- $items := list }}
{{- range $v }}{{ $items = append $items (include "tutti.scalar" .) }}{{ end }}
- name: TUTTI_{{ upper $key }}
  value: {{ join "," $items | quote }}
{{- end }}
{{- else }}
- name: TUTTI_{{ upper $key }}
  value: {{ include "tutti.scalar" $v | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- with include "tutti.etcdEndpoints" . }}
- name: TUTTI_ETCD
  value: {{ . | quote }}
{{- end }}
{{- with include "tutti.mooncakeMaster" . }}
- name: TUTTI_MOONCAKE_MASTER
  value: {{ . | quote }}
{{- end }}
- name: TUTTI_NODE_ID
{{- if $c.node_id }}
  value: {{ $c.node_id | quote }}
{{- else }}
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- end }}
{{- end }}

{{/* The memory tier's settings (memoryTier): for the engines, and for the store nodes with a hostPath. */}}
{{- define "tutti.memoryTierEnv" -}}
- name: TUTTI_MEMORY_PATHS
  value: {{ .Values.memoryTier.path | quote }}
- name: TUTTI_MEMORY_CAPACITY_GB
  value: {{ include "tutti.scalar" .Values.memoryTier.capacityGb | quote }}
{{- end }}

{{/* The memory tier's volume (memoryTier.volume): a memory-backed (or huge-page) emptyDir of the tier's size, or the host's directory. */}}
{{- define "tutti.memoryTierVolume" -}}
- name: memory-tier
{{- if eq .Values.memoryTier.volume "hostPath" }}
  hostPath:
    path: {{ .Values.memoryTier.path }}
    type: DirectoryOrCreate
{{- else }}
  emptyDir:
    medium: {{ eq .Values.memoryTier.volume "hugePages" | ternary "HugePages" "Memory" }}
    sizeLimit: {{ printf "%sGi" (include "tutti.scalar" .Values.memoryTier.capacityGb) }}
{{- end }}
{{- end }}

{{- define "tutti.adminTokenEnv" -}}
- name: TUTTI_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "tutti.adminSecretName" . }}
      key: {{ .Values.admin.existingSecretKey | default "token" }}
{{- end }}

{{/* Checks that no schema can express across keys. */}}
{{- define "tutti.validate" -}}
{{- if and .Values.config.etcd .Values.etcd.enabled }}
{{- fail "config.etcd names an external etcd: set etcd.enabled=false, or leave config.etcd empty to use the chart's etcd" }}
{{- end }}
{{- if and .Values.config.mooncake_master .Values.mooncake.enabled }}
{{- fail "config.mooncake_master names an external master: set mooncake.enabled=false, or leave it null to use the chart's master" }}
{{- end }}
{{- if and .Values.admin.enabled (not (include "tutti.etcdEndpoints" .)) }}
{{- fail "the cluster-wide admin finds the nodes in the cluster directory: enable etcd (etcd.enabled=true) or set config.etcd, or set admin.enabled=false (each node still serves its own admin API)" }}
{{- end }}
{{- $n := len (default (list) .Values.config.paths) }}
{{- $c := len .Values.config.capacity_gb }}
{{- if and (ne $c 1) (ne $c (max $n 1)) }}
{{- fail (printf "config.capacity_gb has %d values for %d paths: give one value for all paths or one per path" $c (max $n 1)) }}
{{- end }}
{{- $m := .Values.memoryTier }}
{{- if $m.enabled }}
{{- if and (ne $m.volume "hostPath") (not .Values.vllm.enabled) }}
{{- fail (printf "memoryTier.volume %s puts the memory tier in the chart's engine pods: set vllm.enabled=true, or memoryTier.volume=hostPath (a tmpfs or hugetlbfs directory of the host) for engines of your own" $m.volume) }}
{{- end }}
{{- $storage := default (list (printf "%s/store" .Values.config.data_dir)) .Values.config.paths }}
{{- range (append $storage .Values.config.data_dir) }}
{{- if eq (clean .) (clean $m.path) }}
{{- fail (printf "memoryTier.path %s is also a storage path or config.data_dir: the memory tier needs a directory of its own" $m.path) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.node.rdma.enabled (ne (toString (default "rdma" .Values.config.protocol)) "rdma") }}
{{- fail "node.rdma.enabled needs config.protocol=rdma (or null)" }}
{{- end }}
{{- $np := .Values.networkPolicy }}
{{- if and $np.enabled (not .Values.config.stage_port) }}
{{- fail "networkPolicy.enabled admits the nodes' stage endpoint on a fixed port: set config.stage_port (e.g. 9482), not 0 or null" }}
{{- end }}
{{- if and $np.enabled .Values.node.rdma.enabled (not $np.nodeCIDRs) }}
{{- fail "node.rdma.enabled puts the nodes and the engines on the host network, where NetworkPolicies see node addresses, not pod labels: list the nodes' CIDRs in networkPolicy.nodeCIDRs (or set networkPolicy.enabled=false)" }}
{{- end }}
{{- $ec := .Values.etcdClient }}
{{- $chartEtcd := and .Values.etcd.enabled (not .Values.config.etcd) }}
{{- if and .Values.etcd.tls.existingSecret $chartEtcd (not (and $ec.existingSecret $ec.caKey $ec.certKey $ec.keyKey)) }}
{{- fail "etcd.tls.existingSecret makes the chart's etcd require client certificates: set etcdClient.existingSecret with caKey, certKey and keyKey (a client certificate from the same CA)" }}
{{- end }}
{{- if $ec.existingSecret }}
{{- if not (include "tutti.etcdEndpoints" .) }}
{{- fail "etcdClient.existingSecret is for the etcd clients of a cluster: enable etcd (etcd.enabled=true) or set config.etcd" }}
{{- end }}
{{- if ne (not $ec.certKey) (not $ec.keyKey) }}
{{- fail "etcdClient: a client certificate needs both certKey and keyKey" }}
{{- end }}
{{- if ne (not $ec.user) (not $ec.passwordKey) }}
{{- fail "etcdClient: etcd's authentication needs both user and passwordKey" }}
{{- end }}
{{- else if $ec.user }}
{{- fail "etcdClient.user needs etcdClient.existingSecret holding the password (passwordKey)" }}
{{- end }}
{{- if and .Values.clusterSecret.value .Values.clusterSecret.existingSecret }}
{{- fail "clusterSecret: give either value or existingSecret, not both" }}
{{- end }}
{{- if and .Values.metrics.token.value .Values.metrics.token.existingSecret }}
{{- fail "metrics.token: give either value or existingSecret, not both" }}
{{- end }}
{{- end }}

{{- define "tutti.clusterSecretName" -}}
{{- .Values.clusterSecret.existingSecret | default (include "tutti.component" (dict "root" . "name" "cluster-secret")) }}
{{- end }}

{{- define "tutti.metricsSecretName" -}}
{{- .Values.metrics.token.existingSecret | default (include "tutti.component" (dict "root" . "name" "metrics-token")) }}
{{- end }}

{{/* Where the credentials init container puts the owner-only copies of the credential files. */}}
{{- define "tutti.credentialsDir" -}}/run/tutti/credentials{{- end }}

{{/*
The credential files of one component, call with (dict "root" $ "component" "node"|"admin"|"vllm"):
a JSON list of {file, secret, key, env}. Each Secret's key is mounted (group-readable, the pod's
fsGroup) and copied by the init container "credentials" to <credentialsDir>/<file>, owned by the
pod's user with mode 0400, because the Tutti processes refuse a credential file that its group or
others may read; env is the TUTTI_* setting that names the copy.
- the cluster credential: the nodes, the engines (stage connections, directory records) and the admin
  plane (it verifies the signed node records before it forwards a request, and the admin token, to
  an address);
- etcd's client files: every Tutti process that reaches etcd;
- the scrape token: the nodes and the admin plane (they serve /metrics).
*/}}
{{- define "tutti.credentials" -}}
{{- $r := .root }}
{{- $out := list }}
{{- if include "tutti.etcdEndpoints" $r }}
{{- $out = append $out (dict "file" "cluster.key" "secret" (include "tutti.clusterSecretName" $r) "key" $r.Values.clusterSecret.existingSecretKey "env" "TUTTI_CLUSTER_SECRET_FILE") }}
{{- $e := $r.Values.etcdClient }}
{{- if $e.existingSecret }}
{{- range $k := list (list "caKey" "etcd-ca.crt" "TUTTI_ETCD_CA_FILE") (list "certKey" "etcd-client.crt" "TUTTI_ETCD_CERT_FILE") (list "keyKey" "etcd-client.key" "TUTTI_ETCD_KEY_FILE") (list "passwordKey" "etcd-password" "TUTTI_ETCD_PASSWORD_FILE") }}
{{- with get $e (index $k 0) }}
{{- $out = append $out (dict "file" (index $k 1) "secret" $e.existingSecret "key" . "env" (index $k 2)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- if and $r.Values.metrics.token.enabled (ne .component "vllm") }}
{{- $out = append $out (dict "file" "metrics-token" "secret" (include "tutti.metricsSecretName" $r) "key" $r.Values.metrics.token.existingSecretKey "env" "TUTTI_METRICS_TOKEN_FILE") }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* The credentials' TUTTI_* settings (same call as tutti.credentials), and TUTTI_ETCD_USER. */}}
{{- define "tutti.credentialsEnv" -}}
{{- range (include "tutti.credentials" . | fromJsonArray) }}
- name: {{ .env }}
  value: {{ printf "%s/%s" (include "tutti.credentialsDir" nil) .file | quote }}
{{- end }}
{{- if and (include "tutti.etcdEndpoints" .root) .root.Values.etcdClient.user }}
- name: TUTTI_ETCD_USER
  value: {{ .root.Values.etcdClient.user | quote }}
{{- end }}
{{- end }}

{{/* The init container that copies the credentials owner-only (same call as tutti.credentials). */}}
{{- define "tutti.credentialsInit" -}}
{{- $creds := include "tutti.credentials" . | fromJsonArray }}
{{- if $creds }}
- name: credentials
  image: {{ include "tutti.image" .root }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  # A Secret's files are root's, or group-readable with the pod's fsGroup; the Tutti processes
  # accept owner-only credential files: copies owned by the pod's user, mode 0400, in memory.
  command:
    - sh
    - -ec
    - |
      {{- range $creds }}
      install -m 0400 /etc/tutti/secrets/{{ .secret }}/{{ .key }} {{ include "tutti.credentialsDir" nil }}/{{ .file }}
      {{- end }}
  securityContext:
    {{- include "tutti.restrictedContainer" dict | nindent 4 }}
  volumeMounts:
    - name: credentials
      mountPath: {{ include "tutti.credentialsDir" nil }}
    {{- range $s := include "tutti.credentialSecrets" . | fromJsonArray }}
    - name: {{ $s.volume }}
      mountPath: /etc/tutti/secrets/{{ $s.secret }}
      readOnly: true
    {{- end }}
{{- end }}
{{- end }}

{{/* The Secrets the credentials come from, one volume each: a JSON list of {volume, secret, keys}. */}}
{{- define "tutti.credentialSecrets" -}}
{{- $by := dict }}
{{- $order := list }}
{{- range (include "tutti.credentials" . | fromJsonArray) }}
{{- if not (hasKey $by .secret) }}
{{- $_ := set $by .secret (list) }}
{{- $order = append $order .secret }}
{{- end }}
{{- $_ := set $by .secret (append (get $by .secret) .key | uniq) }}
{{- end }}
{{- $out := list }}
{{- range $i, $s := $order }}
{{- $out = append $out (dict "volume" (printf "secret-%d" $i) "secret" $s "keys" (get $by $s)) }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* The main container's mount of the copies (same call as tutti.credentials). */}}
{{- define "tutti.credentialsMount" -}}
{{- if include "tutti.credentials" . | fromJsonArray }}
- name: credentials
  mountPath: {{ include "tutti.credentialsDir" nil }}
  readOnly: true
{{- end }}
{{- end }}

{{/* The pod's volumes for the credentials (same call as tutti.credentials). */}}
{{- define "tutti.credentialsVolumes" -}}
{{- if include "tutti.credentials" . | fromJsonArray }}
# In memory only; the init container fills it and the main container reads it.
- name: credentials
  emptyDir:
    medium: Memory
    sizeLimit: 1Mi
{{- range $s := include "tutti.credentialSecrets" . | fromJsonArray }}
- name: {{ $s.volume }}
  secret:
    secretName: {{ $s.secret }}
    # 0440 is what the kubelet makes of any mode with an fsGroup: readable by the pod's group,
    # which only the credentials init container needs.
    defaultMode: 0440
    items:
      {{- range $s.keys }}
      - key: {{ . }}
        path: {{ . }}
      {{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The restricted Pod Security Standard at the container level: no privilege escalation, every
capability dropped, a read-only root file system (not a PSS rule; where a process writes, the
chart mounts a directory for it). runAsNonRoot and seccomp come from tutti.podSecurityContext.
*/}}
{{- define "tutti.restrictedContainer" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end }}

{{/*
The pod's securityContext: non-root, the release's user and group, seccomp RuntimeDefault; fsGroup
(the group of the Secret, emptyDir and claim volumes; host paths keep their owner); file_group
joined where it is a number. Call with (dict "root" $ "dataPath" true|false); dataPath: the
nodes and engines (file_group). With node.rdma.privileged the nodes and engines run as root.
*/}}
{{- define "tutti.podSecurityContext" -}}
{{- $p := .root.Values.podSecurity }}
{{- if and .dataPath .root.Values.node.rdma.privileged }}
# node.rdma.privileged: the devices are opened as root (README.md: "Pod security").
runAsUser: 0
runAsGroup: 0
{{- else }}
runAsNonRoot: true
runAsUser: {{ $p.runAsUser }}
runAsGroup: {{ $p.runAsGroup }}
{{- end }}
fsGroup: {{ $p.runAsGroup }}
{{- $g := .root.Values.config.file_group }}
{{- if and .dataPath (not (kindIs "invalid" $g)) (regexMatch "^[0-9]+$" (include "tutti.scalar" $g)) }}
supplementalGroups: [{{ include "tutti.scalar" $g }}]
{{- end }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* A NetworkPolicy peer: pods with these labels in the namespace of this name. */}}
{{- define "tutti.peer" -}}
- namespaceSelector:
    matchLabels:
      kubernetes.io/metadata.name: {{ .namespace | quote }}
  podSelector:
    matchLabels:
      {{- toYaml .podLabels | nindent 6 }}
{{- end }}
