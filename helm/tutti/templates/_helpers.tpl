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
{{- if and .Values.node.rdma.enabled (ne (toString (default "rdma" .Values.config.protocol)) "rdma") }}
{{- fail "node.rdma.enabled needs config.protocol=rdma (or null)" }}
{{- end }}
{{- end }}
